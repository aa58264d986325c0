"""Each MLX architecture adapter runs its target's layers in an explicit loop exactly as the
model's own forward does: same logits, taps equal to the decoder layers' outputs (recorded here
by test-only wrappers, the oracle), and rollback that leaves the cache as a fresh prefill would.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from mlx_tiny import CONFIGS, build_model, reference_outputs, write_target
from tiny_models import make_drafter

from dflash_local.engines import mlx_engine
from dflash_local.engines.mlx_adapters import adapter_for
from dflash_local.engines.mlx_engine import MLXEngine, MLXTargetRunner
from dflash_local.errors import CheckpointError, IncompatiblePairError

FAMILIES = ["qwen3", "qwen3_moe", "llama", "llama_sliding", "qwen3_5", "qwen3_5_moe", "qwen3_next",
            "gpt_oss", "gemma3_text", "gemma3", "gemma4_text", "gemma4"]
PROMPT = [5, 17, 99, 42, 7, 250, 31, 8, 64, 120, 11, 9]
BLOCK = [77, 3, 3, 140, 200, 6]


@pytest.mark.parametrize("family", FAMILIES)
def test_explicit_loop_equals_model_forward(family):
    model, config = build_model(family)
    adapter = adapter_for(config["model_type"])
    tap_ids = frozenset(range(len(adapter.text_model(model).layers)))
    cache = adapter.make_cache(model)
    for (expected_logits, expected_taps), token_ids in zip(
        reference_outputs(model, adapter.text_model(model).layers, [PROMPT, BLOCK]), [PROMPT, BLOCK]
    ):
        run = adapter.run(model, mx.array([token_ids]), cache, tap_ids)
        logits = np.array(adapter.logits(model, run.hidden)[0])
        np.testing.assert_allclose(logits, expected_logits, atol=1e-4, rtol=1e-4)
        for index in tap_ids:
            np.testing.assert_allclose(np.array(run.taps[index][0]), expected_taps[index], atol=1e-4)


@pytest.mark.parametrize("family", ["qwen3", "llama_sliding", "qwen3_5", "qwen3_next", "gpt_oss",
                                    "gemma3_text", "gemma4_text"])
@pytest.mark.parametrize("kept_rows", [1, 3, 6])
def test_commit_leaves_the_cache_of_a_fresh_prefill(family, kept_rows):
    """verify(6 rows) + commit(k) must equal prefilling the k accepted rows: trim for attention
    caches, restore-and-replay for GatedDeltaNet states (0 < k < 6 is the hard case)."""
    model, config = build_model(family)
    adapter = adapter_for(config["model_type"])
    taps = (1, 2)
    speculative = MLXTargetRunner(model, adapter, taps, max_context=1024)
    speculative.prefill(PROMPT)
    speculative.verify_chain(BLOCK)
    committed_taps = speculative.commit(list(range(kept_rows)))
    fresh = MLXTargetRunner(model, adapter, taps, max_context=1024)
    _, fresh_taps = fresh.prefill(PROMPT + BLOCK[:kept_rows])
    np.testing.assert_allclose(np.array(committed_taps), np.array(fresh_taps[:, len(PROMPT):]),
                               atol=1e-4)
    follow_up = [12, 13, 14]
    # a replayed GatedDeltaNet state is summed in another order than a fresh prefill's: through
    # OpenBLAS (tests/conftest.py installs it, as the engine does) logits differ by up to ~1.1e-4
    np.testing.assert_allclose(speculative.verify_chain(follow_up), fresh.verify_chain(follow_up), atol=2e-4)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_chunked_prefill_equals_one_pass(family, monkeypatch):
    model, config = build_model(family)
    adapter = adapter_for(config["model_type"])
    whole = MLXTargetRunner(model, adapter, (1, 4), max_context=1024).prefill(PROMPT)
    monkeypatch.setattr(mlx_engine, "PREFILL_STEP", 5)
    chunked = MLXTargetRunner(model, adapter, (1, 4), max_context=1024).prefill(PROMPT)
    np.testing.assert_allclose(chunked[0], whole[0], atol=1e-4)
    np.testing.assert_allclose(np.array(chunked[1]), np.array(whole[1]), atol=1e-4)


def test_unsupported_architecture_names_model_type_and_supported():
    with pytest.raises(CheckpointError, match=r"'phi3'.*supported: .*qwen3_5"):
        adapter_for("phi3")


def test_engine_refuses_unsupported_target_before_loading(tmp_path):
    target = write_target(tmp_path / "t", "qwen3")
    raw = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(dict(raw, model_type="gpt2")))
    (target / "model.safetensors").unlink()  # proves nothing was loaded
    with pytest.raises(CheckpointError, match="'gpt2' is not supported by the MLX engine"):
        MLXEngine(target, None)


def test_engine_refuses_incompatible_drafter_before_loading(tmp_path):
    target = write_target(tmp_path / "t", "qwen3")
    drafter = make_drafter(tmp_path / "d", target, taps=[1, 9])
    (target / "model.safetensors").unlink()
    with pytest.raises(IncompatiblePairError, match="drafter tap 9 >= target layers 6"):
        MLXEngine(target, drafter)


def test_all_named_families_have_configs():
    assert {"qwen3", "llama", "qwen3_5", "gemma3", "gemma4"} <= set(CONFIGS)
