"""logprobs on both local engines: each committed token's log-probability and top alternatives,
from the logits the verify computed, equal the plain path's and the log_softmax of the real
model's own forward over the final sequence (computed here, independently of the loop).

Speculative rounds keep several rows of one verify; the drafters are scripted around the real
ones (which still run) so that rounds keep drafts at every depth, on chains, on trees whose kept
path is not their first rows, and on prompt-lookup copies; sampling runs with the real drafter.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fixtures_tiny import (
    ScriptedDrafter,
    ScriptedTreeDrafter,
    collect,
    follow,
    tiny_engine,
    tiny_pair,
)
from test_lookup import lookup_run, repeating_prompt

from dflash_local.errors import InvalidRequestError
from dflash_local.events import GenerationParams, parse_block_size
from dflash_local.method.logprobs import token_logprobs
from dflash_local.method.planning.modes import LOOKUP

TOP = 5
MAX_TOKENS = 24
NEVER = (-1,)  # no stop token: random targets would end early
# A verify of several rows, a one-row step and a whole-sequence forward add the same float32
# products in different orders: logits of magnitude ~10 differ by ~1e-6 relative, ~1e-5 absolute
# (the largest difference measured on the tiny qwen3 was 3.2e-6), and log_softmax (in float64)
# adds nothing. 1e-4 keeps a margin of 30x and stays ten times below the smallest gap between
# two of a row's top 5 tokens there (1.1e-3), so a top-k order cannot flip within it.
TOLERANCE = 1e-4


def qwen3_engine(framework: str, tmp_path_factory):
    """A tiny random Qwen3 pair on `framework` ("transformers" or "mlx": skipped without it)."""
    if framework == "transformers":
        return tiny_engine(tiny_pair(tmp_path_factory, "qwen3"))
    pytest.importorskip("mlx.core")
    from mlx_tiny import write_target
    from tiny_models import make_drafter

    from dflash_local.engines.mlx_engine import MLXEngine

    root = tmp_path_factory.mktemp("mlx-qwen3")
    target = write_target(root / "target", "qwen3", seed=3)
    return MLXEngine(target, make_drafter(root / "drafter", target, layers=2, taps=[1, 3, 4]))


@pytest.fixture(scope="module", params=["transformers", "mlx"])
def engine(request, tmp_path_factory):
    return qwen3_engine(request.param, tmp_path_factory)


def reference_logprobs(engine, prompt_ids: list[int], tokens: list[int]) -> np.ndarray:
    """log_softmax of the target's logits over prompt + tokens in one forward, float64: row i
    is the distribution tokens[i] was drawn from."""
    ids = prompt_ids + tokens[:-1]
    if hasattr(engine, "adapter"):  # MLX
        import mlx.core as mx

        logits = np.array(engine.model(mx.array([ids])).astype(mx.float32))[0]
    else:
        with torch.inference_mode():
            logits = engine.model(torch.tensor([ids])).logits[0].float().numpy()
    rows = logits[len(prompt_ids) - 1 :].astype(np.float64)
    peak = rows.max(-1, keepdims=True)
    return rows - peak - np.log(np.exp(rows - peak).sum(-1, keepdims=True))


def entries(events) -> list:
    """Every token's TokenLogprob, checking there is exactly one per committed token."""
    for event in events:
        assert len(event.logprobs) == len(event.token_ids)
    return [entry for event in events for entry in event.logprobs]


def check_against_model(engine, prompt_ids, tokens, logprobs, greedy=True):
    reference = reference_logprobs(engine, prompt_ids, tokens)
    assert len(logprobs) == len(tokens) == len(reference)
    for row, token, entry in zip(reference, tokens, logprobs):
        assert entry.logprob == pytest.approx(row[token], abs=TOLERANCE)
        assert list(entry.top_ids) == list(np.argsort(-row, kind="stable")[:TOP])
        np.testing.assert_allclose(entry.top_logprobs, row[list(entry.top_ids)], atol=TOLERANCE)
        assert list(entry.top_logprobs) == sorted(entry.top_logprobs, reverse=True)
        if greedy:  # the committed token is the target's argmax: the best of its top-k
            assert entry.top_ids[0] == token and entry.logprob == entry.top_logprobs[0]


def check_equal(spec_logprobs, plain_logprobs):
    """The same tokens' logprobs from a multi-row verify and from one-row steps."""
    assert len(spec_logprobs) == len(plain_logprobs)
    for spec, plain in zip(spec_logprobs, plain_logprobs):
        assert spec.top_ids == plain.top_ids
        assert spec.logprob == pytest.approx(plain.logprob, abs=TOLERANCE)
        np.testing.assert_allclose(spec.top_logprobs, plain.top_logprobs, atol=TOLERANCE)


def stream(engine, prompt_ids, **params):
    if "block_size" in params:
        params["block_size"] = parse_block_size(params["block_size"])
    tokens, events = collect(engine.stream(prompt_ids, GenerationParams(
        max_tokens=MAX_TOKENS, stop_token_ids=NEVER, **params)))
    return tokens, events


@pytest.fixture(scope="module")
def prompt_ids(engine):
    return engine.encode_chat([{"role": "user", "content": "Once upon a time, in a"}])


@pytest.fixture(scope="module")
def plain(engine, prompt_ids):
    tokens, events = stream(engine, prompt_ids, speculative=False, logprobs=TOP)
    check_against_model(engine, prompt_ids, tokens, entries(events))
    without, events_without = stream(engine, prompt_ids, speculative=False)
    assert without == tokens and all(event.logprobs == () for event in events_without)
    return tokens, entries(events)


def scripted(engine, monkeypatch, prompt_ids, reference, tree: bool, right: int):
    """The engine's next generations draft `reference` right for `right` drafts a round, around
    its real drafter; a tree's right path starts at its second node."""
    real = type(engine).make_drafter.__get__(engine)
    script = follow(reference, len(prompt_ids), right=right)

    def make(window=None):
        if tree:
            return ScriptedTreeDrafter(prompt_ids, script, chain=6, inner=real(window))
        return ScriptedDrafter(prompt_ids, script, inner=real(window))

    monkeypatch.setattr(engine, "make_drafter", make)


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("right", [None, 2])
def test_speculative_logprobs_equal_plain_and_the_model(engine, prompt_ids, plain, monkeypatch,
                                                        tree, right):
    plain_tokens, plain_logprobs = plain
    scripted(engine, monkeypatch, prompt_ids, plain_tokens, tree, right)
    tokens, events = stream(engine, prompt_ids, block_size=8, tree=tree, logprobs=TOP)
    assert tokens == plain_tokens
    rounds = events[1:]
    assert max(event.accepted for event in rounds) >= 2  # rows past the anchor's were kept
    assert any(event.draft_depth < event.drafted for event in rounds) is tree
    check_equal(entries(events), plain_logprobs)
    check_against_model(engine, prompt_ids, tokens, entries(events))


def test_real_drafter_rounds_and_top_zero(engine, prompt_ids, plain):
    tokens, events = stream(engine, prompt_ids, block_size=4, logprobs=TOP)
    assert tokens == plain[0]
    check_equal(entries(events), plain[1])
    _, bare = stream(engine, prompt_ids, block_size=4, logprobs=0)  # the logprob alone
    assert all(e.top_ids == e.top_logprobs == () for e in entries(bare))
    # (a kept prefix of the prompt makes this prefill shorter: float rounding again)
    assert [e.logprob for e in entries(bare)] == pytest.approx(
        [e.logprob for e in entries(events)], abs=TOLERANCE)


def test_lookup_rounds_report_the_plain_logprobs(engine, monkeypatch):
    prompt_ids = repeating_prompt(engine)
    reference, plain_events = collect(engine.stream(prompt_ids, GenerationParams(
        max_tokens=60, speculative=False, stop_token_ids=NEVER, logprobs=TOP)))
    tokens, events = lookup_run(engine, monkeypatch, prompt_ids, reference, logprobs=TOP)
    assert tokens == reference
    assert any(event.mode == LOOKUP and event.accepted > 0 for event in events)
    check_equal(entries(events), entries(plain_events))


def test_sampled_tokens_report_the_raw_distribution(engine, prompt_ids):
    """Before temperature and top-p: the model's own log_softmax, whatever drew the token."""
    tokens, events = stream(engine, prompt_ids, block_size=8, temperature=1.5, top_p=0.9, seed=7,
                            logprobs=TOP)
    check_against_model(engine, prompt_ids, tokens, entries(events), greedy=False)
    drawn = [e.top_ids[0] != token for e, token in zip(entries(events), tokens)]
    assert any(drawn)  # some tokens were drawn, not the argmax


def test_token_logprobs_rows_and_ties():
    logits = np.array([[0.0, 2.0, 2.0, -1.0], [1.0, 1.0, 1.0, 1.0]], dtype=np.float32)
    first, second = token_logprobs(logits, [1, 0], [3, 2], top=2)
    assert second.top_ids == (1, 2) and first.top_ids == (0, 1)  # ties: the lower id first
    assert first.logprob == pytest.approx(np.log(0.25))
    expected = 2.0 - np.log(np.exp([0.0, 2.0, 2.0, -1.0]).sum())
    assert second.top_logprobs == pytest.approx((expected, expected))


@pytest.mark.parametrize("value", [-1, 21, True, 2.0])
def test_bad_top_count_is_refused(value):
    with pytest.raises(InvalidRequestError, match=rf"logprobs .*\[0, 20\], got {value!r}"):
        GenerationParams(logprobs=value)
