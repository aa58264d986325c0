"""The prefix cache on the Transformers engine for targets whose cache cannot be trimmed: a
Qwen3.5 hybrid (GatedDeltaNet conv and recurrent states) and Gemma 3 / gpt-oss sliding windows
already past their size. Their layers are kept whole where a prompt ends and where a generation
ends, each reused only by a prompt that extends it whole; every turn gives token for token what
an engine without the cache gives (greedy, float32, the real model classes), a next turn warmed
while idle included."""

from __future__ import annotations

import pytest
from arch_tiny import WINDOW, drafter_for, hf_target
from fixtures_tiny import collect, params_of

from dflash_local.engines.chat_prompt import next_turn_ids
from dflash_local.engines.torch_engine import TorchEngine
from dflash_local.events import GenerationStats

NEVER = 10_000  # a stop id no tiny model emits: runs go to max_tokens
PROMPT = [5, 17, 99, 42, 7, 250, 31, 8, 64, 120, 11, 9]


@pytest.fixture(scope="module", params=["qwen3_5", "gemma3_text", "gpt_oss"])
def engines(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"whole-{request.param}")
    target = hf_target(root / "target", request.param, seed=3)
    drafter = drafter_for(root / "drafter", target)
    return (TorchEngine(target, drafter, prefix_cache_mb=64),
            TorchEngine(target, drafter, prefix_cache=False))


def params(max_tokens=10):
    return params_of(max_tokens=max_tokens, block_size=4, stop_token_ids=(NEVER,))


def both(engines, prompt_ids, max_tokens=10):
    """(tokens, cached tokens) with the cache; asserts the tokens equal the uncached engine's."""
    (tokens, events), (plain, _) = (collect(engine.stream(prompt_ids, params(max_tokens)))
                                    for engine in engines)
    assert tokens == plain
    stats = GenerationStats()
    for event in events:
        stats.add(event)
    return tokens, stats.cached_tokens


def test_turns_reuse_whole_states_and_answer_the_same(engines):
    engine = engines[0]
    engine.prefix_cache.clear()
    assert len(PROMPT) > WINDOW  # sliding layers have dropped rows before anything is kept
    reply, cached = both(engines, PROMPT)
    assert cached == 0
    assert all(entry.kept.whole_only for entry in engine.prefix_cache._entries.values())
    assert len(engine.prefix_cache) == 2  # where the prompt ended and where the generation did
    second = PROMPT + reply + [6, 6]
    reply2, cached = both(engines, second)
    assert cached == len(PROMPT) + len(reply) - 1  # the generation's end, whole
    third = second + reply2 + [7]
    _, cached = both(engines, third)
    assert cached == len(second) + len(reply2) - 1


def test_a_reply_tokenized_otherwise_reuses_the_prompts_state(engines):
    engine = engines[0]
    engine.prefix_cache.clear()
    reply, _ = both(engines, PROMPT)
    _, cached = both(engines, PROMPT + [reply[0] + 1, 3, 3])  # parts from the generated ids at once
    assert cached == len(PROMPT)


def test_an_edited_turn_shares_no_whole_state_and_is_computed_whole(engines):
    engine = engines[0]
    engine.prefix_cache.clear()
    both(engines, PROMPT)
    _, cached = both(engines, PROMPT[:8] + [200, 201, 202, 203])
    assert cached == 0


def test_a_warmed_next_turn_is_reused_whole(engines):
    engine = engines[0]
    engine.prefix_cache.clear()
    talk = [{"role": "user", "content": "a turn"}]
    prompt = engine.encode_chat(talk)
    _, events = collect(engine.stream(prompt, params(12)))
    reply = "".join(event.text for event in events)
    history = next_turn_ids(engine.tokenizer, talk, reply, prompt)
    assert engine.warm_next_turn(talk, reply, prompt, params(12), None, lambda: False)
    talk += [{"role": "assistant", "content": reply}, {"role": "user", "content": "more"}]
    _, cached = both(engines, engine.encode_chat(talk))
    assert cached == len(history)
