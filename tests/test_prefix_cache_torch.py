"""The prefix cache on the Transformers engine is lossless: every turn of a conversation, an
edited earlier turn and interleaved conversations give token for token what an engine without
the cache gives (greedy, float32, tiny random Qwen3 and Llama targets with real drafters); the
drafter's context after a reused prefix is the one a whole prefill builds; a prefill cut short
keeps nothing; a closed stream keeps its state. Plus the policy itself (prefix_cache.py). Targets
kept whole (hybrid, sliding windows): test_prefix_cache_torch_whole.py."""

from __future__ import annotations

import pytest
import torch
from fixtures_tiny import collect, params_of, tiny_pair

from dflash_local.engines.torch_engine import TorchEngine
from dflash_local.errors import InvalidRequestError
from dflash_local.events import GenerationStats
from dflash_local.method.prefix_cache import (
    MIB,
    Kept,
    PrefixCache,
    budget_bytes,
    default_budget_bytes,
)

NEVER = 10_000  # a stop id no tiny model emits: runs go to max_tokens


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def engines(request, tmp_path_factory):
    pair = tiny_pair(tmp_path_factory, request.param)
    return (TorchEngine(pair.target, pair.drafter, prefix_cache_mb=64),
            TorchEngine(pair.target, pair.drafter, prefix_cache=False))


def turn(engine, prompt_ids, block_size=4, max_tokens=12):
    params = params_of(max_tokens=max_tokens, block_size=block_size, stop_token_ids=(NEVER,))
    tokens, events = collect(engine.stream(prompt_ids, params))
    stats = GenerationStats()
    for event in events:
        stats.add(event)
    return tokens, stats


def both(engines, prompt_ids, **kwargs):
    """(tokens, cached tokens) with the cache; asserts the tokens equal the uncached engine's."""
    cached, plain = (turn(engine, prompt_ids, **kwargs) for engine in engines)
    assert cached[0] == plain[0]
    assert plain[1].cached_tokens == 0
    return cached[0], cached[1].cached_tokens


def user(engine, text):
    return engine.encode_chat([{"role": "user", "content": text}])


def test_a_second_turn_reuses_the_first_and_equals_no_cache(engines):
    engine = engines[0]
    engine.prefix_cache.clear()
    prompt = user(engine, "the quick brown fox jumps over the lazy dog")
    reply, cached = both(engines, prompt)
    assert cached == 0  # nothing kept yet: the prompt shares nothing, all of it computed
    second = prompt + reply + engine.encode_raw("and then?")
    _, cached = both(engines, second)
    assert cached == len(prompt) + len(reply) - 1  # every row the first turn left
    _, cached = both(engines, second, block_size=16)  # the same request again
    assert cached == len(second) - 1  # one row is computed: its logits start the reply
    assert len(engine.prefix_cache) == 1  # each entry the next one extends is dropped


def test_an_edited_earlier_turn_reuses_only_the_common_prefix(engines):
    engine = engines[0]
    engine.prefix_cache.clear()
    prompt = user(engine, "tell me about the sea and the ships")
    reply, _ = both(engines, prompt)
    edited = user(engine, "tell me about the mountains")
    _, cached = both(engines, edited)
    shared = next(i for i, (a, b) in enumerate(zip(prompt, edited, strict=False)) if a != b)
    assert cached == shared
    _, cached = both(engines, prompt + reply[:3] + [40, 41])  # the first one still serves
    assert cached == len(prompt) + 3


def test_interleaved_conversations_each_reuse_their_own(engines):
    engine = engines[0]
    engine.prefix_cache.clear()
    talks = {name: user(engine, text) for name, text in
             (("a", "write a poem about rain"), ("b", "how do magnets work"))}
    for _round in range(3):
        for name in ("a", "b", "a"):
            reply, cached = both(engines, talks[name], block_size=8, max_tokens=6)
            if _round:
                assert cached >= len(talks[name]) - 8  # at least the previous turn's prompt
            talks[name] = talks[name] + reply + engine.encode_raw(f" more {name}")
    assert len(engine.prefix_cache) == 2


def test_the_drafter_context_after_a_reused_prefix_is_a_whole_prefills(engines):
    engine = engines[0]
    engine.prefix_cache.clear()
    prompt = user(engine, "count to ten please")
    reply, _ = turn(engine, prompt)
    second = prompt + reply + engine.encode_raw("again")
    turn(engine, second)
    reused = _only_entry(engine.prefix_cache)
    fresh = PrefixCache(64 * MIB)
    engine.prefix_cache, kept = fresh, engine.prefix_cache
    try:
        turn(engine, second)
    finally:
        engine.prefix_cache = kept
    whole = _only_entry(fresh)
    assert (reused.token_ids == whole.token_ids).all()
    a, b = reused.kept.state, whole.kept.state
    assert a.drafter.end == b.drafter.end
    assert a.drafter.end + a.unseen_taps.shape[1] == len(reused.token_ids)
    for x, y in zip([*a.drafter.keys, *a.target[0]], [*b.drafter.keys, *b.target[0]], strict=True):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


def _only_entry(cache):
    assert len(cache) == 1
    return next(iter(cache._entries.values()))


def test_a_prefill_cut_short_keeps_nothing_and_spoils_no_entry(engines, monkeypatch):
    engine = engines[0]
    engine.prefix_cache.clear()
    prompt = user(engine, "a b c d e f")
    reply, _ = both(engines, prompt)
    second = prompt + reply + engine.encode_raw("next")
    real = type(engine).make_runner

    def cut_short(self, collect_taps):
        runner = real(self, collect_taps)
        prefill = runner.prefill

        def fail(prompt_ids, start=0):
            prefill(prompt_ids, start)  # the rows are in the cache, then the request is cancelled
            raise KeyboardInterrupt

        runner.prefill = fail
        return runner

    monkeypatch.setattr(type(engine), "make_runner", cut_short)
    with pytest.raises(KeyboardInterrupt):
        turn(engine, second)
    monkeypatch.undo()
    assert len(engine.prefix_cache) == 1 and len(_only_entry(engine.prefix_cache).token_ids) < len(second)
    _, cached = both(engines, second)  # the entry it restored from is as it was
    assert cached == len(prompt) + len(reply) - 1


def test_a_stream_closed_between_rounds_keeps_its_state(engines):
    engine = engines[0]
    engine.prefix_cache.clear()
    prompt = user(engine, "once upon a time")
    stream = engine.stream(prompt, params_of(max_tokens=30, block_size=4, stop_token_ids=(NEVER,)))
    got = [token for _, event in zip(range(3), stream, strict=False) for token in event.token_ids]
    stream.close()
    entry = _only_entry(engine.prefix_cache)
    assert list(entry.token_ids) == prompt + got[:-1]
    _, cached = both(engines, prompt + got + [50, 51])
    assert cached == len(prompt) + len(got) - 1


def test_plain_decoding_entries_do_not_serve_a_drafter(engines):
    engine = engines[0]
    engine.prefix_cache.clear()
    prompt = user(engine, "plain first")
    reply, _ = turn(engine, prompt, block_size=1)
    _, stats = turn(engine, prompt + reply + [60], block_size=4)
    assert stats.cached_tokens == 0  # no drafter context kept: computed whole
    _, stats = turn(engine, prompt + reply + [60, 61], block_size=1)
    assert stats.cached_tokens == len(prompt) + len(reply) + 1  # the drafter run's entry serves plain
    _, stats = turn(engine, prompt + reply + [60, 61, 62], block_size=4)
    assert stats.cached_tokens > len(prompt)  # the plain run extended it, but dropped it not


def _kept(nbytes, whole_only=False):
    return Kept(state=None, nbytes=nbytes, whole_only=whole_only, has_taps=True)


def test_lru_evicts_whole_entries_to_stay_within_the_budget():
    cache = PrefixCache(budget=100)
    cache.store([1, 2, 3], _kept(40))
    cache.store([4, 5, 6], _kept(40))
    assert cache.lookup([1, 2, 3, 9], needs_taps=True).rows == 3  # touched: now most recent
    cache.store([7, 8, 9], _kept(40))
    assert cache.nbytes <= 100 and len(cache) == 2
    assert cache.lookup([4, 5, 6, 9], needs_taps=True) is None  # the least recently used went
    assert not cache.store([1], _kept(101)) and cache.nbytes <= 100


def test_the_running_total_is_the_sum_of_the_entries_kept():
    cache = PrefixCache(budget=100)

    def summed() -> int:
        return sum(entry.kept.nbytes for entry in cache._entries.values())

    steps = [([1, 2, 3], _kept(30)), ([1, 2, 3], _kept(25)),  # replaced
             ([1, 2, 3, 4], _kept(35)),  # covers the one before: dropped
             ([5, 6], _kept(20, whole_only=True)), ([7], _kept(40)),  # evicts the oldest
             ([8], _kept(100)), ([9], _kept(101))]  # evicts all; too large: not kept
    for ids, kept in steps:
        cache.store(ids, kept)
        assert cache.nbytes == summed() <= cache.budget, ids
    assert cache.nbytes == 100 and len(cache) == 1
    cache.clear()
    assert cache.nbytes == 0 == summed()
    cache.store([1], _kept(10))
    assert cache.nbytes == 10 == summed()


def test_lookup_picks_the_longest_prefix_and_leaves_a_row_to_compute():
    cache = PrefixCache(budget=1000)
    cache.store([1, 2, 3, 4, 5], _kept(1))
    cache.store([1, 2, 9], _kept(1))
    assert cache.lookup([1, 2, 3, 4, 7], needs_taps=True).rows == 4
    assert cache.lookup([1, 2, 3], needs_taps=True).rows == 2  # the prompt's last row is computed
    assert cache.lookup([8, 1, 2], needs_taps=True) is None  # shares nothing


def test_a_whole_only_entry_serves_only_prompts_that_extend_it():
    cache = PrefixCache(budget=1000)
    cache.store([1, 2, 3], _kept(1, whole_only=True))
    assert cache.lookup([1, 2, 3, 4], needs_taps=True).rows == 3
    assert cache.lookup([1, 2, 3], needs_taps=True) is None  # would need a trim
    assert cache.lookup([1, 2, 7, 8], needs_taps=True) is None
    cache.store([1, 2, 3, 4, 5], _kept(1, whole_only=True))
    assert len(cache) == 2  # the shorter snapshot still serves an edit after it
    cache.store([1, 2, 3], _kept(2, whole_only=True))
    assert len(cache) == 2 and cache.nbytes == 3  # the same rows again: the newer replaces it


def test_budgets_of_zero_or_more_than_the_machine_are_refused():
    with pytest.raises(InvalidRequestError, match="--prefix-cache-mb must be >= 1, got 0"):
        budget_bytes(0, 8 << 30)
    with pytest.raises(InvalidRequestError, match="more than this machine's memory"):
        budget_bytes(9000, 8 << 30)
    assert budget_bytes(512, 8 << 30) == 512 * MIB
    assert default_budget_bytes(1000, 8 << 30) == 1000 * 65536
    assert default_budget_bytes(10**6, 8 << 30) == 1 << 30  # an eighth of the machine at most


def test_a_cache_with_layers_it_can_neither_trim_nor_keep_whole_says_why():
    from transformers import Qwen3Config, StaticCache

    from dflash_local.engines.torch_prefix import TorchPrefixStates

    config = Qwen3Config(num_hidden_layers=2)

    class Runner:  # what snapshot reads of a runner: its real cache
        cache = StaticCache(config=config, max_cache_len=8)

    reason = TorchPrefixStates().snapshot(Runner(), None, None)
    assert isinstance(reason, str) and "StaticLayer" in reason and "neither trimmed" in reason
