"""Tool calls end to end: the real server, the official openai SDK, a tiny target trained to call
get_weather (agent_tiny.py), speculation on and off."""

from __future__ import annotations

import json

import httpx
import pytest
from agent_tiny import AGENT_TOOLS, ANSWER, CALL_ARGUMENTS, TOOL_RESULT, agent_pair, first_turn
from service_support import assert_openai_error, openai_client, serve_module


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    pair = agent_pair(tmp_path_factory)
    yield from serve_module(tmp_path_factory, (pair.target, pair.drafter))


@pytest.fixture(scope="module")
def client(service):
    return openai_client(service[1])


def ask(client, messages, **extra):
    return client.chat.completions.create(model="tiny", messages=messages, tools=AGENT_TOOLS,
                                          **{"max_tokens": 120, **extra})


def answer_turn(call) -> list[dict]:
    """The first turn, the model's call as the SDK returned it, the tool's result."""
    return [*first_turn(), {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": TOOL_RESULT}]


def test_round_trip_with_the_openai_sdk(client):
    reply = ask(client, first_turn())
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == CALL_ARGUMENTS

    final = ask(client, answer_turn(call)).choices[0]
    assert final.finish_reason == "stop"
    assert final.message.content == ANSWER and not final.message.tool_calls


def test_an_assistant_call_may_leave_content_out_as_openai_allows(client):
    reply = ask(client, first_turn())
    (call,) = reply.choices[0].message.tool_calls
    turn = answer_turn(call)
    del turn[-2]["content"]
    final = ask(client, turn).choices[0]
    assert final.message.content == ANSWER


def test_streamed_round_trip_as_openai_streams_it(client):
    chunks = list(ask(client, first_turn(), stream=True))
    pieces = [piece for chunk in chunks for piece in chunk.choices[0].delta.tool_calls or ()]
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    first, *rest = pieces
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather"
    assert all(piece.index == 0 and piece.id is None for piece in rest)
    arguments = first.function.arguments + "".join(piece.function.arguments for piece in rest)
    assert json.loads(arguments) == CALL_ARGUMENTS

    call = ask(client, first_turn()).choices[0].message.tool_calls[0]
    text_chunks = list(ask(client, answer_turn(call), stream=True))
    assert "".join(chunk.choices[0].delta.content or "" for chunk in text_chunks) == ANSWER
    assert text_chunks[-1].choices[0].finish_reason == "stop"


def streamed_ids(server, messages, **extra) -> tuple[list[int], list[dict]]:
    """The committed token ids (from each chunk's `dflash`) and the chunks' deltas."""
    body = {"model": "tiny", "messages": messages, "tools": AGENT_TOOLS, "max_tokens": 120,
            "stream": True, **extra}
    ids, deltas = [], []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                ids += chunk["dflash"]["token_ids"]
                deltas.append(chunk["choices"][0]["delta"])
    return ids, deltas


def without_ids(deltas: list[dict]) -> list[dict]:
    return [{**delta, "tool_calls": [{**piece, "id": None} for piece in delta.get("tool_calls", [])]}
            for delta in deltas]


@pytest.mark.parametrize("turn", ["call", "answer"])
def test_speculation_is_lossless_with_tools(service, client, turn):
    messages = first_turn()
    if turn == "answer":
        messages = answer_turn(ask(client, first_turn()).choices[0].message.tool_calls[0])
    plain_ids, plain = streamed_ids(service[1], messages, speculative=False)
    for block_size in (4, 8):
        ids, deltas = streamed_ids(service[1], messages, speculative=True, block_size=block_size)
        assert ids == plain_ids
        assert "".join(d.get("content") or "" for d in deltas) == "".join(d.get("content") or "" for d in plain)
        calls = [piece for d in deltas for piece in d.get("tool_calls", [])]
        assert [{**p, "id": None} for p in calls] == [{**p, "id": None} for p in
                                                     (piece for d in plain for piece in d.get("tool_calls", []))]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_choice_calls(service, client, tool_choice):
    """Forcing ends the prompt with the call's opener: the reply continues the call, and its
    tokens are the unforced reply's after the opener's."""
    choice = ask(client, first_turn(), tool_choice=tool_choice).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == CALL_ARGUMENTS
    free_ids, _ = streamed_ids(service[1], first_turn())
    forced_ids, _ = streamed_ids(service[1], first_turn(), tool_choice=tool_choice)
    assert len(forced_ids) < len(free_ids) and free_ids[-len(forced_ids):] == forced_ids


def test_tool_choice_none_renders_without_tools_and_parses_nothing(client):
    choice = ask(client, first_turn(), tool_choice="none").choices[0]
    assert not choice.message.tool_calls
    assert choice.finish_reason != "tool_calls"


def test_a_stop_inside_the_call_leaves_it_text(client):
    choice = ask(client, first_turn(), stop=["Paris"]).choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == '<tool_call>{"name": "get_weather", "arguments": {"city": "'


def test_max_tokens_inside_the_call_leaves_it_text(client):
    choice = ask(client, first_turn(), max_tokens=10).choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content == '<tool_call>{"name": '  # the opener and 9 characters


def test_a_call_to_an_unknown_tool_is_text(client):
    """The model calls get_weather; offered only another tool, its call is its text."""
    other = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    choice = client.chat.completions.create(model="tiny", messages=first_turn(), tools=other,
                                            max_tokens=120).choices[0]
    assert not choice.message.tool_calls and choice.finish_reason != "tool_calls"


def test_bad_tool_requests_name_the_field(service):
    url = service[1].url + "/v1/chat/completions"
    cases = {
        "tools.0.function.parameters": {"tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "string"}}}]},
        "tool_choice": {"tools": AGENT_TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "messages.1.tool_call_id": {"messages": [*first_turn()[1:], {"role": "tool", "content": "x"}]},
        "messages.1.tool_calls": {"messages": [*first_turn()[1:], {"role": "assistant", "content": None,
                                                                   "tool_calls": [{"id": "c", "type": "function"}]}]},
    }
    for field, extra in cases.items():
        body = {"messages": first_turn(), "max_tokens": 4, **extra}
        error = assert_openai_error(httpx.post(url, json=body, timeout=30), 400, "invalid_request")
        assert field in error["message"], (field, error["message"])
