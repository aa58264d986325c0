"""The prefix cache on the MLX engine is lossless: turns, an edited earlier turn and
interleaved conversations give token for token what an engine without the cache gives (greedy,
float32), on tiny random Qwen3 and Llama targets and a Qwen3.5 hybrid, whose GatedDeltaNet
state is kept where a generation ended and reused only whole; a next turn warmed while idle
(engines/turn_warmup.py) is reused whole."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("mlx.core")

import mlx.core as mx
import numpy as np
from mlx_tiny import write_target
from tiny_models import make_drafter

from dflash_local.engines.mlx_engine import MLXEngine
from dflash_local.events import GenerationParams, GenerationStats, parse_block_size
from dflash_local.method.prefix_cache import MIB, PrefixCache

NEVER = -1  # random targets emit EOS early: never stop on it here
PROMPT = [1, 40, 71, 88, 101, 33, 72, 99, 12, 250, 5, 64]


def _drafter_for(tmp_path, target_dir):
    raw = json.loads((target_dir / "config.json").read_text())
    flat = tmp_path / "flat_config"
    flat.mkdir(exist_ok=True)
    (flat / "config.json").write_text(json.dumps(raw.get("text_config") or raw))
    return make_drafter(tmp_path / "drafter", flat, seed=1, layers=2, block_size=8, taps=[1, 3, 4])


@pytest.fixture(scope="module", params=["qwen3", "llama", "qwen3_5"])
def engines(request, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp(f"prefix_{request.param}")
    target_dir = write_target(tmp_path / "target", request.param, seed=3)
    drafter_dir = _drafter_for(tmp_path, target_dir)
    return (MLXEngine(target_dir, drafter_dir, prefix_cache_mb=64),
            MLXEngine(target_dir, drafter_dir, prefix_cache=False))


def turn(engine, prompt_ids, block_size=4, max_tokens=10):
    params = GenerationParams(max_tokens=max_tokens, block_size=parse_block_size(block_size),
                              stop_token_ids=(NEVER,))
    stats, tokens = GenerationStats(), []
    for event in engine.stream(prompt_ids, params):
        stats.add(event)
        tokens.extend(event.token_ids)
    return tokens, stats.cached_tokens


def both(engines, prompt_ids, **kwargs):
    (tokens, cached), (plain, uncached) = (turn(engine, prompt_ids, **kwargs) for engine in engines)
    assert tokens == plain and uncached == 0
    return tokens, cached


def hybrid(engine) -> bool:
    return engine.make_runner(collect_taps=False).hybrid


def test_turns_reuse_what_the_last_one_left(engines):
    engine = engines[0]
    engine.prefix_cache.clear()
    reply, cached = both(engines, PROMPT)
    assert cached == 0
    second = PROMPT + reply + [7, 8, 9]
    reply2, cached = both(engines, second, block_size=8)
    assert cached == len(PROMPT) + len(reply) - 1
    third = second + reply2 + [10, 11]
    _, cached = both(engines, third, block_size=1)  # plain decoding reuses a drafter run's entry
    assert cached == len(second) + len(reply2) - 1


def test_a_reply_tokenized_otherwise_still_reuses_the_prompt(engines):
    """The next prompt holds the reply as the tokenizer writes it, not as it was generated:
    the match ends there, and a hybrid, which cannot trim, reuses its snapshot of the prompt."""
    engine = engines[0]
    engine.prefix_cache.clear()
    reply, _ = both(engines, PROMPT)
    retokenized = [(reply[0] + 1) % 200, *reply[1:]]
    _, cached = both(engines, PROMPT + retokenized + [4, 4])
    assert cached == len(PROMPT)


def test_a_warmed_next_turn_reuses_the_reply_as_respelled(engines):
    """turn_warmup.warm prefills the history as the next request spells it (here: the reply's
    first id otherwise) from the prompt's kept state; the next turn reuses all of it."""
    import threading

    from dflash_local.engines import turn_warmup

    engine = engines[0]
    engine.prefix_cache.clear()
    reply, _ = both(engines, PROMPT)
    history = PROMPT + [(reply[0] + 1) % 200, *reply[1:], 2]
    params = GenerationParams(block_size=parse_block_size(4))
    assert turn_warmup.warm(engine, history, params, lambda: False, threading.Lock())
    _, cached = both(engines, history + [4, 4])
    assert cached == len(history)


def test_an_edited_turn_reuses_the_common_prefix_or_nothing_on_a_hybrid(engines):
    engine = engines[0]
    engine.prefix_cache.clear()
    reply, _ = both(engines, PROMPT)
    edited = PROMPT[:6] + [200, 201, 202]
    _, cached = both(engines, edited)
    # a hybrid's recurrent state cannot be trimmed back to the edit: computed whole
    assert cached == (0 if hybrid(engine) else 6)
    _, cached = both(engines, PROMPT + reply + [3])
    assert cached == len(PROMPT) + len(reply) - 1  # the first conversation's entry still serves


def test_interleaved_conversations(engines):
    engine = engines[0]
    engine.prefix_cache.clear()
    talks = {"a": PROMPT, "b": [9, 90, 91, 92, 93, 94, 95]}  # nothing in common
    for index in range(2):
        for name in ("a", "b"):
            reply, cached = both(engines, talks[name], block_size=8, max_tokens=6)
            assert cached == (0 if index == 0 else len(talks[name]) - 3)  # all but the 2 new ids and the last reply token
            talks[name] = talks[name] + reply + [20 + index, 30]


def test_the_same_request_again(engines):
    engine = engines[0]
    engine.prefix_cache.clear()
    reply, _ = both(engines, PROMPT)
    second = PROMPT + reply + [5]
    both(engines, second)
    _, cached = both(engines, second)
    # a hybrid cannot trim its last row off: the earlier turn's snapshot serves instead
    assert cached == (len(PROMPT) + len(reply) - 1 if hybrid(engine) else len(second) - 1)


def test_the_drafter_context_after_a_reused_prefix_is_a_whole_prefills(engines):
    engine = engines[0]
    engine.prefix_cache.clear()
    reply, _ = turn(engine, PROMPT)
    second = PROMPT + reply + [6, 6]
    turn(engine, second)
    reused = _last_entry(engine.prefix_cache)
    engine.prefix_cache, kept = PrefixCache(64 * MIB), engine.prefix_cache
    try:
        turn(engine, second)
        whole = _last_entry(engine.prefix_cache)
    finally:
        engine.prefix_cache = kept
    a, b = reused.kept.state, whole.kept.state
    assert list(reused.token_ids) == list(whole.token_ids)
    assert a.drafter.end == b.drafter.end
    assert a.drafter.end + a.unseen_taps.shape[1] == len(reused.token_ids)
    for x, y in zip(a.drafter.layers + a.target, b.drafter.layers + b.target, strict=True):
        for u, v in zip(x, y, strict=True):
            np.testing.assert_allclose(np.array(u.astype(mx.float32)), np.array(v.astype(mx.float32)),
                                       atol=1e-4, rtol=1e-4)


def _last_entry(cache):
    return list(cache._entries.values())[-1]
