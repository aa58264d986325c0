"""Warming the next turn (engines/turn_warmup.py) on the Transformers engine: the conversation
as the next request spells it is prefilled from the longest kept prefix and kept, so the next
turn reuses every row of it and still answers token for token what an engine without the cache
answers (tiny random Qwen3 and Llama pairs: their replies re-tokenize otherwise than generated);
a warm-up stopped between chunks, or while a generation is open, stores nothing; a template
that writes the history otherwise than the prompt it extends is not warmed."""

from __future__ import annotations

import numpy as np
import pytest
from fixtures_tiny import collect, params_of, tiny_pair

from dflash_local.engines import turn_warmup
from dflash_local.engines.chat_prompt import next_turn_ids
from dflash_local.engines.torch_engine import TorchEngine
from dflash_local.events import GenerationStats
from dflash_local.method.prefix_cache import common_prefix

NEVER = 10_000  # a stop id no tiny model emits: runs go to max_tokens
PARAMS = params_of(max_tokens=40, block_size=4, stop_token_ids=(NEVER,))


def no_job_waits() -> bool:
    return False


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def engines(request, tmp_path_factory):
    pair = tiny_pair(tmp_path_factory, request.param)
    return (TorchEngine(pair.target, pair.drafter, prefix_cache_mb=64),
            TorchEngine(pair.target, pair.drafter, prefix_cache=False))


def answer(engine, messages):
    """(reply tokens, reply text, cached tokens) of one turn."""
    tokens, events = collect(engine.stream(engine.encode_chat(messages), PARAMS))
    stats = GenerationStats()
    for event in events:
        stats.add(event)
    return tokens, "".join(event.text for event in events), stats.cached_tokens


def first_turn(engine, text):
    engine.prefix_cache.clear()
    talk = [{"role": "user", "content": text}]
    tokens, reply, _ = answer(engine, talk)
    return talk, engine.encode_chat(talk), tokens, reply


def test_the_next_turn_reuses_the_warmed_history_and_answers_the_same(engines):
    engine, plain = engines
    talk, prompt, tokens, reply = first_turn(engine, "write a long list of colours")
    history = next_turn_ids(engine.tokenizer, talk, reply, prompt)
    # the case the warm-up is for: the reply re-tokenizes otherwise than it was generated
    assert common_prefix(np.array(prompt + tokens), np.array(history)) < len(history) - 2
    assert engine.warm_next_turn(talk, reply, prompt, PARAMS, None, no_job_waits)
    assert any(entry.token_ids.tolist() == history for entry in engine.prefix_cache._entries.values())
    talk += [{"role": "assistant", "content": reply}, {"role": "user", "content": "and more?"}]
    tokens, _, cached = answer(engine, talk)
    assert cached >= len(history)  # every row of the conversation so far
    assert tokens == answer(plain, talk)[0]
    # warmed again, nothing new to compute: nothing is stored twice
    assert not engine.warm_next_turn(talk[:1], reply, prompt, PARAMS, None, no_job_waits)


def test_a_warm_up_stopped_between_chunks_stores_nothing(engines, monkeypatch):
    engine = engines[0]
    monkeypatch.setattr(turn_warmup, "WARM_CHUNK_ROWS", 4)
    talk, prompt, _, reply = first_turn(engine, "say something about the weather")
    before = [(entry.token_ids.tolist(), entry.kept.nbytes)
              for entry in engine.prefix_cache._entries.values()]
    asked = []

    def queued_after_two_chunks() -> bool:
        asked.append(1)
        return len(asked) > 3  # the start, two chunks, then a job arrives

    assert not engine.warm_next_turn(talk, reply, prompt, PARAMS, None, queued_after_two_chunks)
    assert len(asked) == 4
    assert [(entry.token_ids.tolist(), entry.kept.nbytes)
            for entry in engine.prefix_cache._entries.values()] == before


def test_no_warm_up_runs_while_a_generation_is_open(engines):
    engine = engines[0]
    talk, prompt, _, reply = first_turn(engine, "count to twenty")
    stream = engine.stream(prompt, PARAMS)
    next(stream)  # a caller of its own (the bench, a test) is generating
    assert not engine.warm_next_turn(talk, reply, prompt, PARAMS, None, no_job_waits)
    stream.close()
    history = next_turn_ids(engine.tokenizer, talk, reply, prompt)
    assert all(entry.token_ids.tolist() != history for entry in engine.prefix_cache._entries.values())
    assert engine.warm_next_turn(talk, reply, prompt, PARAMS, None, no_job_waits)  # closed: it runs


def test_a_template_that_writes_history_otherwise_is_not_warmed(engines):
    tokenizer = engines[0].tokenizer
    talk = [{"role": "user", "content": "hi"}]
    prompt = engines[0].encode_chat(talk)
    assert next_turn_ids(tokenizer, talk, "hello", prompt) is not None
    kept = tokenizer.chat_template
    # a reasoning template's habit: the turn being answered opens with a block the history drops
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
    try:
        assert next_turn_ids(tokenizer, talk, "hello", engines[0].encode_chat(talk)) is None
    finally:
        tokenizer.chat_template = kept
