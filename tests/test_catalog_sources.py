"""The catalog's invariants: every hub repo it names is cited in docs/catalog-sources.md, every
MLX build says how it is stored and how big it is, its block size follows its quantization, and
a bad `arch` or quantization is refused naming the pair and the value."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dflash_local.errors import CheckpointError
from dflash_local.pairs.catalog import load_catalog

SOURCES = Path(__file__).resolve().parent.parent / "docs" / "catalog-sources.md"
ROW = re.compile(r"^\| `([^`]+)` \| (.+) \|$")
CITATION = re.compile(r"https://\S+|[\w.-]+/[\w.-]+@[0-9a-f]{7}")
BLOCK_BY_QUANTIZATION = {"bf16": 16, "8bit": 8, "4bit": 4, "mxfp4": 4}


def cited() -> dict[str, str]:
    rows = (ROW.match(line) for line in SOURCES.read_text().splitlines())
    return {row[1]: row[2] for row in rows if row}


def test_every_hub_repo_is_cited_with_a_place_it_was_seen():
    sources = cited()
    missing = sorted(load_catalog().hub_repos() - set(sources))
    assert not missing, f"not cited in {SOURCES.name}: {missing}"
    unplaced = {repo: where for repo, where in sources.items() if not CITATION.search(where)}
    assert not unplaced, f"cited without a URL or repo@commit: {unplaced}"


def test_mlx_builds_say_how_they_are_stored_and_their_block_size_follows():
    mlx_builds = [pair for pair in load_catalog().pairs
                  if pair.target.repo.startswith("mlx-community/")]
    assert len(mlx_builds) >= 20
    for pair in mlx_builds:
        assert pair.engines == ("mlx",), pair.id
        assert pair.target.quantization in BLOCK_BY_QUANTIZATION, pair.id
        assert pair.target.size_gb or pair.target.params_b, pair.id  # published, or estimated
        # the rule by quantization; a DFlash 2 drafter's block is measured smaller (cited)
        rule = BLOCK_BY_QUANTIZATION[pair.target.quantization]
        assert (pair.block_size_for("mlx") <= rule if pair.drafter_version == 2
                else pair.block_size_for("mlx") == rule), pair.id


def test_the_architectures_mac_users_run_are_in_the_catalog():
    local = load_catalog().local_model_types()
    for model_type in ("qwen3_5", "qwen3_5_moe", "gemma4", "gpt_oss", "qwen3_next", "qwen3_moe",
                       "llama"):
        assert "mlx" in local[model_type], model_type


CATALOG_HEAD = ('[[pair]]\nid = "embedded"\nengines = ["mlx"]\nthinking = "on"\nmodel_type = "llama"\n'
                'block_size = { mlx = 4 }\ndrafter = { repo = "d", source = "shipped" }\n')


@pytest.mark.parametrize(("extra", "message"), [
    ('arch = { num_hidden_layers = 2, head_dim = 8 }\ntarget = { repo = "t", source = "embedded" }\n',
     r"'embedded'\) arch: unknown keys \[\] or missing \['num_key_value_heads'\]"),
    (('arch = { num_hidden_layers = 2, num_key_value_heads = 0, head_dim = 8 }\n'
      'target = { repo = "t", source = "embedded" }\n'),
     r"arch: \{'num_key_value_heads': 0\} must be positive integers"),
    (('arch = { num_hidden_layers = 2, num_key_value_heads = 1, head_dim = 8, layers = 3 }\n'
      'target = { repo = "t", source = "embedded" }\n'), r"arch: unknown keys \['layers'\]"),
    (('arch = { num_hidden_layers = 2, num_key_value_heads = 1, head_dim = 8, '
      'layer_types = ["full_attention"] }\ntarget = { repo = "t", source = "embedded" }\n'),
     r"arch: layer_types must list one layer kind \(a string\) per layer, 2 in all"),
    (('arch = { num_hidden_layers = 1, num_key_value_heads = 1, head_dim = 8, '
      'layer_types = [3] }\ntarget = { repo = "t", source = "embedded" }\n'),
     r"arch: layer_types must list one layer kind .* got \[3\]"),
    ('target = { repo = "t", source = "embedded", quantization = "3bit" }\n',
     r"'embedded'\) target: quantization '3bit' is not one of"),
])
def test_a_bad_arch_or_quantization_names_the_pair_and_the_value(tmp_path, extra, message):
    path = tmp_path / "catalog.toml"
    path.write_text(CATALOG_HEAD + extra)
    with pytest.raises(CheckpointError, match=message):
        load_catalog(path)
