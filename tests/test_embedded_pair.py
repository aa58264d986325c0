"""The embedded pair as shipped: SmolLM2-135M-Instruct (imported from the GGUF) with the drafter
in models/, through both engines. Speculative equals plain token for token (greedy, float32) on
held-out prompts, at fixed block sizes and with the auto policy; the two engines agree."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures_tiny import params_of

from dflash_local import paths
from dflash_local.bench.datasets import load_prompts

TOKENS = 40
PROMPTS = [p.turns[0] for p in load_prompts("embedded", 2)] + [
    "Write a Python function that returns the n-th Fibonacci number."]


@pytest.fixture(scope="module")
def drafter_dir() -> Path:
    path = paths.shipped_models_dir() / "smollm2-135m-dflash"
    assert (path / "model.safetensors").is_file(), "the embedded drafter must ship in models/"
    return path


def tokens(engine, prompt: str, **params) -> tuple[list[int], list]:
    ids = engine.encode_chat([{"role": "user", "content": prompt}])
    events = list(engine.stream(ids, params_of(max_tokens=TOKENS, **params)))
    return [t for e in events for t in e.token_ids], events


@pytest.fixture(scope="module")
def torch_engine(embedded_target_dir, drafter_dir):
    from dflash_local.engines.torch_engine import TorchEngine

    return TorchEngine(embedded_target_dir, drafter_dir)


@pytest.fixture(scope="module")
def mlx_engine(embedded_target_dir, drafter_dir):
    pytest.importorskip("mlx_lm")  # a dependency on Linux and macOS: present in CI
    from dflash_local.engines.mlx_engine import MLXEngine

    return MLXEngine(embedded_target_dir, drafter_dir)


# MLX on this CPU is several times slower than torch for this target: fewer cases there (the
# tiny-model tests cover MLX's block sizes and the auto policy thoroughly)
@pytest.mark.parametrize(("engine_name", "prompts", "block_sizes"), [
    ("torch_engine", PROMPTS, (4, 16, "auto")),
    ("mlx_engine", PROMPTS[2:], (4, 16)),
])
def test_speculative_equals_plain_on_the_shipped_pair(request, engine_name, prompts, block_sizes):
    engine = request.getfixturevalue(engine_name)
    assert engine.pair.dtype == "float32"
    drafted = 0
    for prompt in prompts:
        plain, _ = tokens(engine, prompt, speculative=False)
        assert len(plain) > 5
        for block_size in block_sizes:
            spec, events = tokens(engine, prompt, block_size=block_size)
            assert spec == plain, (prompt, block_size)
            drafted += sum(e.drafted for e in events)
    assert drafted > 0  # the drafter really ran


def test_both_engines_agree_round_for_round(torch_engine, mlx_engine):
    prompt = PROMPTS[2]
    torch_ids, torch_events = tokens(torch_engine, prompt, block_size=8)
    mlx_ids, mlx_events = tokens(mlx_engine, prompt, block_size=8)
    assert torch_ids == mlx_ids
    # the same drafter weights on the same taps: the same accepted count in (nearly) every round
    same = sum(a.accepted == b.accepted for a, b in zip(torch_events, mlx_events))
    assert len(torch_events) == len(mlx_events) and same >= len(torch_events) - 1


# 30 layers of float32 sums in another order (a 16-row verify against one-row steps): the largest
# difference of a logprob measured on this pair (64 tokens, top 20) was 6.5e-5; 1e-3 keeps a margin
# of 15x, and a row mixed up with another would be off by whole units
EMBEDDED_LOGPROB_TOLERANCE = 1e-3


def test_logprobs_of_speculative_rounds_equal_plain_on_the_shipped_pair(torch_engine):
    """The bar on the real pair, whose drafter is right often: several rows of one verify
    report the same logprobs as one-row steps."""
    prompt = PROMPTS[2]
    plain, plain_events = tokens(torch_engine, prompt, speculative=False, logprobs=5)
    spec, spec_events = tokens(torch_engine, prompt, block_size=16, logprobs=5)
    assert spec == plain
    assert max(e.accepted for e in spec_events) >= 3
    plain_lp = [lp for e in plain_events for lp in e.logprobs]
    spec_lp = [lp for e in spec_events for lp in e.logprobs]
    assert len(spec_lp) == len(plain_lp) == len(plain)
    assert all(lp.top_ids[0] == token for lp, token in zip(spec_lp, spec))  # greedy
    for ours, theirs in zip(spec_lp, plain_lp):
        assert ours.logprob == pytest.approx(theirs.logprob, abs=EMBEDDED_LOGPROB_TOLERANCE)
        assert ours.top_logprobs == pytest.approx(theirs.top_logprobs, abs=EMBEDDED_LOGPROB_TOLERANCE)
        for rank, (ours_id, theirs_id) in enumerate(zip(ours.top_ids, theirs.top_ids)):
            # the same ids, but for two alternatives tied within the rounding, which may swap
            assert ours_id == theirs_id or _near_tie(theirs.top_logprobs, rank)


def _near_tie(values, rank: int) -> bool:
    neighbours = [values[i] for i in (rank - 1, rank + 1) if 0 <= i < len(values)]
    return any(abs(values[rank] - value) < 2 * EMBEDDED_LOGPROB_TOLERANCE for value in neighbours)
