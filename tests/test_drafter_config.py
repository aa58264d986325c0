"""Drafter config parsing (both schema generations, v1 and DFlash 2) and the compatibility check."""

from __future__ import annotations

import copy
import json
import re

import pytest

from dflash_local.drafter.config import (
    DrafterConfig,
    TargetInfo,
    check_compatible,
    default_target_layer_ids,
    load_drafter_config,
    parse_drafter_config,
    to_checkpoint_json,
)
from dflash_local.errors import CheckpointError

# a Qwen3-8B drafter's config.json as z-lab shipped it in 2025 (older schema)
OLDER = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
    "hidden_size": 4096, "num_hidden_layers": 5, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "attention_bias": False,
    "rope_theta": 1000000, "rope_scaling": None, "num_target_layers": 36, "block_size": 16,
    "dflash_config": {"target_layer_ids": [1, 9, 17, 25, 33], "mask_token_id": 151669},
}
TARGET = TargetInfo(model_type="qwen3", vocab_size=151936, hidden_size=4096, num_hidden_layers=36,
                    embedding_rows=151936, max_position_embeddings=40960)


def newer_schema() -> dict:
    """The 2026 form: block_size in dflash_config, RoPE in rope_parameters, layer types."""
    raw = copy.deepcopy(OLDER)
    del raw["block_size"], raw["rope_theta"], raw["rope_scaling"]
    raw["dflash_config"]["block_size"] = 10
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 5000000.0}
    raw["layer_types"] = ["sliding_attention"] * 4 + ["full_attention"]
    raw["sliding_window"] = 2048
    return raw


def test_older_schema():
    config = parse_drafter_config(OLDER)
    assert config.version == "dflash"
    assert config.block_size == 16
    assert config.target_layer_ids == (1, 9, 17, 25, 33)
    assert config.mask_token_id == 151669
    assert config.rope_theta == 1_000_000.0 and config.rope_scaling is None
    assert config.layer_types == () and config.sliding_window is None
    assert not any(config.layer_is_causal(i) or config.layer_is_sliding(i) for i in range(5))
    assert check_compatible(config, TARGET) == []


def test_newer_schema_with_layer_types():
    config = parse_drafter_config(newer_schema())
    assert config.block_size == 10
    assert config.rope_theta == 5_000_000.0 and config.rope_scaling is None
    assert config.sliding_window == 2048
    assert [config.layer_is_sliding(i) for i in range(5)] == [True] * 4 + [False]
    assert [config.layer_is_causal(i) for i in range(5)] == [True] * 4 + [False]
    assert check_compatible(config, TARGET) == []


def test_is_causal_overrides_layer_types():
    raw = newer_schema()
    raw["is_causal"] = False
    config = parse_drafter_config(raw)
    assert not any(config.layer_is_causal(i) for i in range(5))
    assert config.layer_is_sliding(0)
    raw.pop("layer_types")
    raw["is_causal"] = True
    assert all(parse_drafter_config(raw).layer_is_causal(i) for i in range(5))


def test_block_size_in_dflash_config_wins_over_top_level():
    raw = newer_schema()
    raw["block_size"] = 16
    assert parse_drafter_config(raw).block_size == 10


def test_scaled_rope_in_both_schemas():
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    older = {**OLDER, "rope_scaling": yarn}
    newer = {**newer_schema(), "rope_parameters": {**yarn, "rope_theta": 1e6}}
    for raw in (older, newer):
        config = parse_drafter_config(raw)
        assert config.rope_theta == 1e6
        assert config.rope_scaling["rope_type"] == "yarn" and config.rope_scaling["factor"] == 4.0
        assert "rope_theta" not in config.rope_scaling


DFLASH2_FIELDS = {"conv_kernel_size": 4, "conv_group_size": 64, "selector_rank": 32,
                  "selector_top_k": 8}


def dflash2_schema(**fields) -> dict:
    raw = {**newer_schema(), "architectures": ["DFlash2DraftModel"]}
    raw["dflash_config"] = {**raw["dflash_config"], **DFLASH2_FIELDS, **fields}
    return {**raw, "dflash_config": {k: v for k, v in raw["dflash_config"].items() if v is not None}}


def test_dflash2_is_parsed_and_written_back():
    config = parse_drafter_config(dflash2_schema())
    assert config.version == "dflash2" and check_compatible(config, TARGET) == []
    assert {name: getattr(config.dflash2, name) for name in DFLASH2_FIELDS} == DFLASH2_FIELDS
    assert parse_drafter_config(to_checkpoint_json(config)) == config
    assert parse_drafter_config(OLDER).dflash2 is None


@pytest.mark.parametrize("fields, message", [
    ({"selector_rank": None}, "DFlash 2 drafter without dflash_config.selector_rank"),
    ({"conv_group_size": 48}, "dflash_config.conv_group_size 48 does not divide hidden_size 4096"),
    ({"conv_kernel_size": 0}, "dflash_config.conv_kernel_size must be an integer >= 1, got 0"),
    ({"selector_top_k": "8"}, "dflash_config.selector_top_k must be an integer >= 1, got '8'"),
    ({"selector_top_k": 151937}, "dflash_config.selector_top_k 151937 > vocab_size 151936"),
])
def test_a_malformed_dflash2_config_names_the_field_and_the_value(fields, message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        parse_drafter_config(dflash2_schema(**fields))


def test_unknown_architecture_is_named():
    raw = {**OLDER, "architectures": ["EagleDraftModel"]}
    with pytest.raises(CheckpointError, match=r"\['EagleDraftModel'\] is not a DFlash drafter"):
        parse_drafter_config(raw)
    with pytest.raises(CheckpointError, match=r"\[\] is not a DFlash drafter"):
        parse_drafter_config({k: v for k, v in OLDER.items() if k != "architectures"})


def test_missing_fields_are_named():
    raw = copy.deepcopy(OLDER)
    del raw["dflash_config"]["mask_token_id"]
    with pytest.raises(CheckpointError, match="mask_token_id is missing"):
        parse_drafter_config(raw)
    raw = copy.deepcopy(OLDER)
    del raw["block_size"]
    with pytest.raises(CheckpointError, match="no block_size"):
        parse_drafter_config(raw)
    raw = copy.deepcopy(OLDER)
    del raw["hidden_size"]
    with pytest.raises(CheckpointError, match="'hidden_size' is missing"):
        parse_drafter_config(raw)


def test_layer_types_length_must_match():
    raw = newer_schema()
    raw["layer_types"] = raw["layer_types"][:3]
    with pytest.raises(CheckpointError, match="layer_types has 3 entries for 5 layers"):
        parse_drafter_config(raw)


def test_default_taps():
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # Qwen3-8B
    assert default_target_layer_ids(36, 1) == (18,)
    assert default_target_layer_ids(7, 1) == (3,)
    assert default_target_layer_ids(28, 2) == (1, 25)


def test_default_taps_match_zlab_rounding():
    """Python's round() halves to even (L=10, 5 layers: 2.5 -> 2): same as z-lab's helper."""
    zlab = pytest.importorskip("dflash.model")  # test-only oracle
    assert default_target_layer_ids(10, 5) == (1, 2, 4, 6, 7)
    for target_layers in range(4, 65):
        for draft_layers in range(1, 9):
            expected = tuple(zlab.build_target_layer_ids(target_layers, draft_layers))
            assert default_target_layer_ids(target_layers, draft_layers) == expected


def test_default_taps_used_when_absent():
    raw = copy.deepcopy(OLDER)
    del raw["dflash_config"]["target_layer_ids"]
    assert parse_drafter_config(raw).target_layer_ids == (1, 9, 17, 25, 33)
    raw["num_hidden_layers"] = 1
    assert parse_drafter_config(raw).target_layer_ids == (18,)
    del raw["num_target_layers"]
    with pytest.raises(CheckpointError,
                       match="target_layer_ids is missing and so is num_target_layers"):
        parse_drafter_config(raw)


def test_load_from_directory(tmp_path):
    with pytest.raises(CheckpointError, match="has no config.json"):
        load_drafter_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="is not valid JSON"):
        load_drafter_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(newer_schema()))
    assert load_drafter_config(tmp_path).block_size == 10


def incompatible(**changes) -> list[str]:
    config = parse_drafter_config(OLDER)
    fields = {name: getattr(config, name) for name in DrafterConfig.__dataclass_fields__}
    return check_compatible(DrafterConfig(**{**fields, **changes}), TARGET)


@pytest.mark.parametrize("changes, expected", [
    ({"vocab_size": 32000}, "drafter vocab_size 32000 != target vocab_size 151936"),
    ({"hidden_size": 2560}, "drafter hidden_size 2560 != target hidden_size 4096"),
    ({"target_layer_ids": (1, 9, 40)}, "drafter tap 40 >= target layers 36"),
    ({"target_layer_ids": (-1, 9)}, "drafter tap -1 is negative"),
    ({"mask_token_id": 151936},
     "mask_token_id 151936 is outside the target's embedding table of 151936 rows"),
    ({"version": "dflash3"}, "drafter architecture 'dflash3' is not supported by this engine"),
    ({"num_target_layers": 28},
     "drafter was trained for a target of 28 layers, this target has 36"),
])
def test_each_compatibility_failure_names_the_values(changes, expected):
    reasons = incompatible(**changes)
    assert len(reasons) == 1
    assert reasons[0].startswith(expected)


def test_every_failure_is_reported_at_once():
    reasons = incompatible(vocab_size=1, hidden_size=2, target_layer_ids=(36,))
    assert len(reasons) == 3


def test_a_written_config_carries_every_key_qwen3config_save_pretrained_writes(tmp_path):
    # z-lab's checkpoints are Qwen3Config.save_pretrained files, and public loaders (dflash-mlx,
    # mlx-dspark) read keys such as tie_word_embeddings from them: ours must carry the same set.
    from transformers import Qwen3Config

    config = parse_drafter_config(dflash2_schema())
    written = to_checkpoint_json(config)
    Qwen3Config(**{key: written[key] for key in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "intermediate_size", "vocab_size")}).save_pretrained(tmp_path)
    expected = set(json.loads((tmp_path / "config.json").read_text())) - {"transformers_version"}
    assert expected - set(written) == set()
    assert written["tie_word_embeddings"] is False
    assert written["rope_parameters"] == {"rope_type": "default", "rope_theta": config.rope_theta}


def test_rope_scaling_survives_both_spellings_of_a_written_config():
    scaled = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
    config = parse_drafter_config({**OLDER, "rope_scaling": scaled, "rope_theta": 5e5})
    written = to_checkpoint_json(config)
    assert written["rope_parameters"] == {**scaled, "rope_theta": 5e5}
    assert parse_drafter_config(written) == config
    legacy = {key: value for key, value in written.items() if key != "rope_parameters"}
    assert parse_drafter_config(legacy) == config


def test_a_target_config_without_a_model_type_says_so(tmp_path):
    from dflash_local.drafter.config import load_target_info

    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2}))
    with pytest.raises(CheckpointError, match="names no model_type"):
        load_target_info(tmp_path)
    nested = {"model_type": "gemma4", "text_config": {"model_type": "gemma4_text", "hidden_size": 64,
                                                        "num_hidden_layers": 2, "vocab_size": 10}}
    assert load_target_info(tmp_path, nested).model_type == "gemma4"  # the outer name, as engines use
