"""Speculative decoding equals plain decoding, token for token (greedy, float32, CPU), through
TorchEngine.stream on tiny Qwen3 and Llama targets with z-lab-format drafters loaded from disk.

Random drafters are rarely right, so the acceptance paths (all accepted, none, exactly k, a stop
token inside a block) are forced with scripted drafters that wrap the real one (it still runs).
"""

from __future__ import annotations

import pytest
import torch
from fixtures_tiny import ScriptedDrafter, collect, follow, params_of, tiny_engine, tiny_pair

from dflash_local.accel.torch_linear import packing_available
from dflash_local.drafter.model_torch import DraftSession
from dflash_local.engines.torch_engine import TapCollector
from dflash_local.errors import PromptTooLongError
from dflash_local.events import GenerationStats

PROMPTS = ["hello world", "def add(a, b):\n    return", "Once upon a time, in a"]
NEVER = 10_000  # a stop id no tiny model emits: runs go to max_tokens


@pytest.fixture(scope="session", params=["qwen3", "llama"])
def engine(request, tmp_path_factory):
    return tiny_engine(tiny_pair(tmp_path_factory, request.param))


@pytest.fixture(scope="session")
def plain_runs():
    return {}


def run(engine, prompt_ids, **params):
    return collect(engine.stream(prompt_ids, params_of(**params)))


def plain(engine, prompt_ids, cache=None, **params):
    key = (id(engine), tuple(prompt_ids), tuple(sorted(params.items())))
    if cache is None or key not in cache:
        tokens, _ = run(engine, prompt_ids, speculative=False, **params)
        if cache is None:
            return tokens
        cache[key] = tokens
    return cache[key]


def chat(engine, text: str) -> list[int]:
    return engine.encode_chat([{"role": "user", "content": text}])


@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_speculative_equals_plain(engine, plain_runs, block_size):
    for text in PROMPTS:
        prompt_ids = chat(engine, text)
        expected = plain(engine, prompt_ids, plain_runs, max_tokens=20)
        tokens, events = run(engine, prompt_ids, max_tokens=20, block_size=block_size)
        assert tokens == expected, text
        assert all(event.width <= block_size for event in events)
        assert events[-1].finish_reason in ("stop", "length")


def script_engine(engine, monkeypatch, prompt_ids, script, block_size=16):
    """Make the engine's next generation draft from `script`, around a real DraftSession."""
    drafters = []

    def make_drafter(window=None):
        inner = DraftSession(engine.drafter, window=window)
        drafters.append(ScriptedDrafter(prompt_ids, script, drafter_block=block_size, inner=inner))
        return drafters[-1]

    monkeypatch.setattr(engine, "make_drafter", make_drafter)
    return drafters


def test_stop_token_inside_a_block(engine, monkeypatch):
    prompt_ids = chat(engine, PROMPTS[0])
    continuation = plain(engine, prompt_ids, max_tokens=24, stop_token_ids=(NEVER,))
    stop_at = next(i for i in range(3, 12) if continuation[i] not in continuation[:i])
    stop_id = continuation[stop_at]
    expected = continuation[: stop_at + 1]
    assert plain(engine, prompt_ids, max_tokens=24, stop_token_ids=(stop_id,)) == expected

    script_engine(engine, monkeypatch, prompt_ids, follow(continuation, len(prompt_ids)))
    tokens, events = run(engine, prompt_ids, max_tokens=24, block_size=16,
                         stop_token_ids=(stop_id,))
    assert tokens == expected
    assert len(events) == 2  # the prefill token, then one round whose block held the stop token
    assert events[-1].finish_reason == "stop"
    assert events[-1].accepted == stop_at  # drafts 1..stop_at, the stop token included


@pytest.mark.parametrize("block_size, max_tokens", [(16, 10), (4, 7), (4, 1)])
def test_max_tokens_inside_a_block(engine, monkeypatch, block_size, max_tokens):
    prompt_ids = chat(engine, PROMPTS[1])
    continuation = plain(engine, prompt_ids, max_tokens=24, stop_token_ids=(NEVER,))
    real, _ = run(engine, prompt_ids, max_tokens=max_tokens, block_size=block_size,
                  stop_token_ids=(NEVER,))
    assert real == continuation[:max_tokens]

    script_engine(engine, monkeypatch, prompt_ids, follow(continuation, len(prompt_ids)))
    tokens, events = run(engine, prompt_ids, max_tokens=max_tokens, block_size=block_size,
                         stop_token_ids=(NEVER,))
    assert tokens == continuation[:max_tokens]
    assert events[-1].finish_reason == "length"


def scripted_stats(engine, monkeypatch, right, block_size, max_tokens):
    prompt_ids = chat(engine, PROMPTS[2])
    continuation = plain(engine, prompt_ids, max_tokens=max_tokens, stop_token_ids=(NEVER,))
    drafters = script_engine(engine, monkeypatch, prompt_ids,
                             follow(continuation, len(prompt_ids), right=right))
    tokens, events = run(engine, prompt_ids, max_tokens=max_tokens, block_size=block_size,
                         stop_token_ids=(NEVER,))
    assert tokens == continuation
    stats = GenerationStats()
    for event in events:
        stats.add(event)
    return stats, events, drafters[0]


def test_forced_right_drafter_commits_whole_blocks(engine, monkeypatch):
    stats, events, _ = scripted_stats(engine, monkeypatch, right=None, block_size=4, max_tokens=20)
    assert stats.accepted_per_round == [4, 4, 4, 4, 3]  # 1 + 19 tokens: the last round is partial
    assert all(event.accepted == event.drafted == event.width - 1 for event in events[1:])


def test_forced_wrong_drafter_commits_one_token_per_round(engine, monkeypatch):
    stats, events, _ = scripted_stats(engine, monkeypatch, right=0, block_size=4, max_tokens=12)
    assert stats.accepted_per_round == [1] * 11
    assert stats.tau == 1.0
    assert all(event.accepted == 0 for event in events[1:])


def test_partially_right_drafter_accepts_exactly_k(engine, monkeypatch):
    k = 2
    stats, events, drafter = scripted_stats(engine, monkeypatch, right=k, block_size=8,
                                            max_tokens=25)
    assert [event.accepted for event in events[1:]] == [k] * 8
    assert stats.accepted_per_round == [k + 1] * 8
    assert drafter.accepted_seen == [k] * 7  # the taps handed back cover exactly the kept rows
    assert drafter.inner.cache.end == len(drafter.context)  # real drafter: no rejected row kept


def test_prompt_longer_than_context(engine):
    too_long = [5] * (engine.capabilities.max_context + 1)
    with pytest.raises(PromptTooLongError, match="exceeds the target's context"):
        run(engine, too_long, max_tokens=4)
    fits_alone = [5] * (engine.capabilities.max_context - 2)
    with pytest.raises(PromptTooLongError):
        run(engine, fits_alone, max_tokens=8)


def test_taps_are_hidden_states_shifted_by_one(engine):
    """Tap i = output of decoder layer i = HF hidden_states[i + 1], the last layer included."""
    layers = engine.model.config.num_hidden_layers
    collector = TapCollector(engine.model, (0, 2, layers - 1))
    try:
        ids = torch.tensor([chat(engine, PROMPTS[0])])
        collector.enabled = True
        with torch.inference_mode():
            out = engine.model(ids, output_hidden_states=True)
        taps = collector.take()
    finally:
        for handle in collector._handles:
            handle.remove()
    expected = torch.cat([out.hidden_states[i + 1] for i in (0, 2, layers - 1)], dim=-1)
    torch.testing.assert_close(taps, expected, rtol=0, atol=0)


def test_accepted_characters_are_the_text_of_the_accepted_drafts(engine, monkeypatch):
    """Each event says how much of its text the accepted drafts made (for exact colouring):
    the text of every round's accepted tokens, decoded in stream order."""
    k = 2
    _, events, _ = scripted_stats(engine, monkeypatch, right=k, block_size=8, max_tokens=25)
    assert "".join(e.text for e in events) == engine.decode([t for e in events for t in e.token_ids])
    for event in events[1:]:
        assert 0 <= event.accepted_chars <= len(event.text)
        bonus, drafts = engine.decode(event.token_ids[k:]), engine.decode(event.token_ids[:k])
        if "\ufffd" not in bonus + drafts:  # a split UTF-8 character waits for its next token
            assert event.text[event.accepted_chars:] == bonus  # what follows is the bonus token's
    assert sum(event.accepted_chars > 0 for event in events[1:]) >= 4


@pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN")
def test_the_cpu_float32_linears_are_packed_and_the_tied_head_still_computes_the_same_logits(engine):
    import torch.nn.functional as F

    from dflash_local.accel.torch_linear import PackedLinear

    assert not any(type(m) is torch.nn.Linear for m in (*engine.model.modules(), *engine.drafter.modules()))
    head = engine.model.get_output_embeddings()
    assert isinstance(head, PackedLinear)
    assert engine.model.config.tie_word_embeddings  # the tiny targets tie, as SmolLM2 does
    assert head.weight is engine.model.get_input_embeddings().weight  # kept, not copied
    rows = torch.randn(1, 5, head.in_features)
    torch.testing.assert_close(head(rows), F.linear(rows, engine.model.get_input_embeddings().weight),
                               rtol=1e-5, atol=1e-5)
    assert engine.drafter._borrowed[1] is head  # the drafter's logits go through it too
