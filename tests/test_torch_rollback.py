"""The Transformers runner's rollback leaves the cache a fresh prefill would: verify 6 rows, keep
k, and the taps of the kept rows and the logits of the next rows equal those of a runner that
prefilled the k rows with the prompt. GatedDeltaNet layers (their recurrent and conv states),
sliding windows already past their size (the prompt is longer than the window) and full
attention, each through the real model classes."""

from __future__ import annotations

import pytest
import torch
from arch_tiny import WINDOW, drafter_for, hf_target

from dflash_local.engines.torch_engine import TorchEngine

PROMPT = [5, 17, 99, 42, 7, 250, 31, 8, 64, 120, 11, 9]
BLOCK = [77, 3, 3, 140, 200, 6]
FOLLOW_UP = [12, 13, 14]


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next", "gpt_oss", "gemma4", "qwen3"])
def engine(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    target = hf_target(root / "target", request.param, seed=3)
    return TorchEngine(target, drafter_for(root / "drafter", target))


@pytest.mark.parametrize("kept_rows", [1, 3, 6])
def test_commit_leaves_the_cache_of_a_fresh_prefill(engine, kept_rows):
    assert len(PROMPT) > WINDOW  # sliding layers have dropped rows before the verify
    speculative = engine.make_runner(collect_taps=True)
    speculative.prefill(PROMPT)
    speculative.verify_chain(BLOCK)
    kept_taps = speculative.commit(list(range(kept_rows)))
    fresh = engine.make_runner(collect_taps=True)
    _, fresh_taps = fresh.prefill(PROMPT + BLOCK[:kept_rows])
    torch.testing.assert_close(kept_taps, fresh_taps[:, len(PROMPT):], atol=1e-4, rtol=1e-4)
    # a GatedDeltaNet state built row by row and one built in chunks differ in rounding only
    torch.testing.assert_close(torch.from_numpy(speculative.verify_chain(FOLLOW_UP)),
                               torch.from_numpy(fresh.verify_chain(FOLLOW_UP)), atol=2e-4, rtol=1e-4)


def test_the_record_is_dropped_after_each_forward(engine):
    """Sliding layers keep no more than their window, GatedDeltaNet layers no per-row history:
    memory stays bounded however many rounds run."""
    runner = engine.make_runner(collect_taps=False)
    runner.prefill(PROMPT)
    for _ in range(3):
        runner.verify_chain(BLOCK)
        runner.commit([0, 1])
    for layer in runner.cache.layers:
        if getattr(layer, "is_sliding", False):
            assert layer.keys.shape[-2] == layer.sliding_window - 1
        for history in getattr(layer, "recurrent_states_history", {}).values():
            assert history == []
        for index, conv in getattr(layer, "conv_states", {}).items():
            if conv is not None:
                assert conv.shape[-1] == layer.conv_kernel_size[index]
