"""A harmony (gpt-oss) target end to end: the real server, the official openai SDK, a tiny target
trained to reply in harmony's channels and to call get_weather (harmony_tiny.py)."""

from __future__ import annotations

import json

import httpx
import pytest
from agent_tiny import AGENT_TOOLS, ANSWER, CALL_ARGUMENTS, TOOL_RESULT, first_turn
from harmony_tiny import (
    CALL_REASONING,
    CALL_REPLY,
    HELLO,
    PLAIN_REPLY,
    REASONING,
    greeting,
    harmony_pair,
)
from service_support import openai_client, serve_module


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    pair = harmony_pair(tmp_path_factory)
    yield from serve_module(tmp_path_factory, (pair.target, pair.drafter))


@pytest.fixture(scope="module")
def client(service):
    return openai_client(service[1])


def ask(client, messages, **extra):
    return client.chat.completions.create(model="tiny", messages=messages, **{"max_tokens": 160, **extra})


def reasoning_of(message) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")


def test_a_plain_reply_is_its_final_channel_with_the_analysis_as_reasoning(client):
    choice = ask(client, greeting()).choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == HELLO  # not "analysisGreet back.assistantfinalHello there!"
    assert reasoning_of(choice.message) == REASONING


def test_a_streamed_plain_reply_keeps_the_channels_apart(client):
    chunks = list(ask(client, greeting(), stream=True))
    deltas = [chunk.choices[0].delta for chunk in chunks]
    assert "".join(delta.content or "" for delta in deltas) == HELLO
    assert "".join(reasoning_of(delta) or "" for delta in deltas) == REASONING
    assert chunks[-1].choices[0].finish_reason == "stop"


def answer_turn(call) -> list[dict]:
    return [*first_turn(system=False),
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": TOOL_RESULT}]


def test_round_trip_with_the_openai_sdk(client):
    choice = ask(client, first_turn(system=False), tools=AGENT_TOOLS).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert reasoning_of(choice.message) == CALL_REASONING
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == CALL_ARGUMENTS

    final = ask(client, answer_turn(call), tools=AGENT_TOOLS).choices[0]
    assert final.finish_reason == "stop"
    assert final.message.content == ANSWER and not final.message.tool_calls


def test_a_streamed_call_as_openai_streams_it(client):
    chunks = list(ask(client, first_turn(system=False), tools=AGENT_TOOLS, stream=True))
    deltas = [chunk.choices[0].delta for chunk in chunks]
    assert "".join(delta.content or "" for delta in deltas) == ""
    assert "".join(reasoning_of(delta) or "" for delta in deltas) == CALL_REASONING
    first, *rest = [piece for delta in deltas for piece in delta.tool_calls or ()]
    assert first.function.name == "get_weather"
    arguments = first.function.arguments + "".join(piece.function.arguments for piece in rest)
    assert json.loads(arguments) == CALL_ARGUMENTS
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def streamed(server, messages, **extra) -> tuple[list[int], list[dict]]:
    """The committed token ids (each chunk's `dflash`) and the chunks' deltas."""
    body = {"model": "tiny", "messages": messages, "max_tokens": 160, "stream": True, **extra}
    ids, deltas = [], []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                ids += chunk["dflash"]["token_ids"]
                deltas.append(chunk["choices"][0]["delta"])
    return ids, deltas


def joined(deltas: list[dict], key: str) -> str:
    return "".join(delta.get(key) or "" for delta in deltas)


@pytest.mark.parametrize("turn", ["plain", "call"])
def test_speculation_is_lossless_on_the_harmony_target(service, turn):
    messages, extra = (greeting(), {}) if turn == "plain" else (first_turn(system=False), {"tools": AGENT_TOOLS})
    plain_ids, plain = streamed(service[1], messages, speculative=False, **extra)
    for block_size in (4, 8):
        ids, deltas = streamed(service[1], messages, speculative=True, block_size=block_size, **extra)
        assert ids == plain_ids
        for key in ("content", "reasoning_content"):
            assert joined(deltas, key) == joined(plain, key)
        calls = [{**piece, "id": None} for delta in deltas for piece in delta.get("tool_calls", [])]
        assert calls == [{**piece, "id": None} for delta in plain for piece in delta.get("tool_calls", [])]


def test_call_ends_the_turn(service):
    """<|call|> is an end-of-turn id: the reply's last token is it, nothing after."""
    state = service[0]
    tokenizer = state.loaded.engine.tokenizer
    ids, _ = streamed(service[1], first_turn(system=False), tools=AGENT_TOOLS)
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|call|>")
    assert tokenizer.convert_tokens_to_ids("<|call|>") not in ids[:-1]


def test_a_call_cut_by_max_tokens_is_text(client):
    choice = ask(client, first_turn(system=False), tools=AGENT_TOOLS, max_tokens=80).choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content.startswith("<|start|>assistant<|channel|>commentary to=functions.get_weather")
    assert reasoning_of(choice.message) == CALL_REASONING



@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_follow_the_reply_with_its_markers(client, stream):
    """One entry per token but the <|return|> that ends the reply; their tokens spell it."""
    reply = ask(client, greeting(), logprobs=True, stream=stream)
    chunks = list(reply) if stream else [reply]
    entries = [entry for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
               for entry in chunk.choices[0].logprobs.content]
    assert "".join(entry.token for entry in entries) == PLAIN_REPLY.removesuffix("<|return|>")


@pytest.mark.parametrize("engine", ["transformers", "mlx"])
def test_both_local_engines_write_the_markers_and_stop_at_the_call(service, engine):
    """The engines' text is the reply with its markers; speculation gives plain decoding's ids."""
    from dflash_local.engines.torch_engine import TorchEngine
    from dflash_local.events import GenerationParams

    pair = service[0].loaded.engine.pair
    if engine == "mlx":
        pytest.importorskip("mlx.core")
        from dflash_local.engines.mlx_engine import MLXEngine
        local = MLXEngine(pair.target_path, pair.drafter_path)
    else:
        local = TorchEngine(pair.target_path, pair.drafter_path)
    prompt = local.encode_chat(first_turn(system=False), tools=AGENT_TOOLS)
    runs = {}
    for speculative in (False, True):
        events = list(local.stream(prompt, GenerationParams(max_tokens=160, speculative=speculative)))
        runs[speculative] = ([i for event in events for i in event.token_ids],
                             "".join(event.text for event in events), events[-1].finish_reason)
    assert runs[True] == runs[False]
    assert runs[True][1:] == (CALL_REPLY, "stop")
    local.close()


def test_a_completion_is_the_raw_continuation_with_its_markers(service):
    """/v1/completions continues a raw prompt: its text is every generated token's, channels and
    markers included (a harmony tokenizer's detokenizer keeps them), none split out."""
    state, server = service
    tokenizer = state.loaded.engine.tokenizer
    prompt = tokenizer.encode(tokenizer.apply_chat_template(greeting(), tokenize=False,
                                                            add_generation_prompt=True),
                              add_special_tokens=False)
    reply = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"model": "tiny", "prompt": prompt, "max_tokens": 160}).json()
    assert reply["choices"][0]["text"] == PLAIN_REPLY, reply
