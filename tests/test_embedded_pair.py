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


def test_logprobs_of_speculative_rounds_equal_plain_on_the_shipped_pair(torch_engine):
    """The bar on the real pair, whose drafter is right often: several rows of one verify
    report the same logprobs as one-row steps (test_logprobs.py: the tolerance; the largest
    difference measured on this pair is printed on failure)."""
    prompt = PROMPTS[2]
    plain, plain_events = tokens(torch_engine, prompt, speculative=False, logprobs=5)
    spec, spec_events = tokens(torch_engine, prompt, block_size=16, logprobs=5)
    assert spec == plain
    assert max(e.accepted for e in spec_events) >= 3
    plain_lp = [lp for e in plain_events for lp in e.logprobs]
    spec_lp = [lp for e in spec_events for lp in e.logprobs]
    assert len(spec_lp) == len(plain_lp) == len(plain)
    assert [lp.top_ids for lp in spec_lp] == [lp.top_ids for lp in plain_lp]
    assert all(lp.top_ids[0] == token for lp, token in zip(spec_lp, spec))  # greedy
    gap = max(abs(a - b) for s, p in zip(spec_lp, plain_lp)
              for a, b in zip((s.logprob, *s.top_logprobs), (p.logprob, *p.top_logprobs)))
    assert gap < 1e-4, gap
