"""Tool round trips through /v1/messages (the `anthropic` SDK) and /v1/responses (the `openai`
SDK): question -> a parsed tool call -> the tool's result -> the final answer, against the real
server on tests/agent_tiny.py's trained target, streamed and not, speculative equal to plain,
and the same call and answer as /v1/chat/completions gives for the same conversation."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from agent_tiny import (
    ANSWER,
    CALL_ARGUMENTS,
    QUESTION,
    SYSTEM,
    TOOL_RESULT,
    WEATHER_TOOL,
    agent_pair,
    first_turn,
)
from anthropic.types import Message, RawMessageStreamEvent
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from service_support import start_service

FUNCTION = WEATHER_TOOL["function"]
CLAUDE_TOOL = {"name": FUNCTION["name"], "description": FUNCTION["description"],
               "input_schema": FUNCTION["parameters"]}
RESPONSES_TOOL = {"type": "function", **FUNCTION}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pair = agent_pair(tmp_path_factory)
    _state, server = start_service(pair.target, pair.drafter, hub_cache_dir=tmp_path_factory.mktemp("hub"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def gpt(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def claude_turns(claude, stream: bool, **extra) -> tuple:
    """The round trip through the anthropic SDK: (the call's message, the answer's message)."""
    def send(messages):
        request = {"model": "tiny", "max_tokens": 64, "system": SYSTEM, "tools": [CLAUDE_TOOL],
                   "messages": messages, **extra}
        if not stream:
            return claude.messages.create(**request)
        with claude.messages.stream(**request) as events:
            return events.get_final_message()

    question = [{"role": "user", "content": QUESTION}]
    call = send(question)
    use = call.content[-1]
    answer = send([*question, {"role": "assistant", "content": call.content},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                 "content": TOOL_RESULT}]}])
    return call, answer


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_sdk_tool_round_trip(claude, stream):
    call, answer = claude_turns(claude, stream)
    assert call.stop_reason == "tool_use"
    assert [block.type for block in call.content] == ["tool_use"]
    use = call.content[0]
    assert use.id.startswith("toolu_") and use.name == "get_weather" and use.input == CALL_ARGUMENTS
    assert answer.stop_reason == "end_turn"
    assert [block.type for block in answer.content] == ["text"]
    assert answer.content[0].text == ANSWER


def test_anthropic_tool_use_streams_as_input_json_deltas(server):
    body = {"model": "tiny", "max_tokens": 64, "system": SYSTEM, "tools": [CLAUDE_TOOL],
            "stream": True, "messages": [{"role": "user", "content": QUESTION}]}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=60) as response:
        events = [json.loads(line.removeprefix("data: ")) for line in response.iter_lines()
                  if line.startswith("data: ")]
    kinds = [e["type"] for e in events if e["type"] != "ping"]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [block["type"] for block in starts] == ["tool_use"]
    assert starts[0]["input"] == {} and starts[0]["name"] == "get_weather"
    pieces = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"]
    assert json.loads("".join(pieces)) == CALL_ARGUMENTS
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


def raw_events(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as response:
        return [json.loads(line.removeprefix("data: ")) for line in response.iter_lines()
                if line.startswith("data: ")]


def streamed_token_ids(server, path: str, body: dict) -> list[int]:
    """Every token the reply committed, from the raw events' per-round `dflash`."""
    return [token for e in raw_events(server, path, body) if "dflash" in e for token in e["dflash"]["token_ids"]]


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
def test_tool_call_replies_validate_as_the_sdks_types(server, path):
    # the SDKs build their objects without validation: validate strictly, every required field
    if path == "/v1/messages":
        body = {"model": "tiny", "max_tokens": 64, "system": SYSTEM, "tools": [CLAUDE_TOOL],
                "messages": CLAUDE_SECOND_TURN[:1]}
        whole, event, kinds = Message, RawMessageStreamEvent, lambda reply: [b.type for b in reply.content]
    else:
        body = {"model": "tiny", "max_output_tokens": 64, "instructions": SYSTEM,
                "tools": [RESPONSES_TOOL], "input": RESPONSES_SECOND_TURN[:1]}
        whole, event, kinds = Response, ResponseStreamEvent, lambda reply: [i.type for i in reply.output]
    reply = whole.model_validate(httpx.post(server.url + path, json=body, timeout=60).json())
    assert kinds(reply) in (["tool_use"], ["function_call"])
    events = [e for e in raw_events(server, path, body) if e["type"] != "ping"]
    assert [TypeAdapter(event).validate_python(e).type for e in events] == [e["type"] for e in events]


CLAUDE_SECOND_TURN = [
    {"role": "user", "content": QUESTION},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                       "input": CALL_ARGUMENTS}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": TOOL_RESULT}]}]
RESPONSES_SECOND_TURN = [
    {"role": "user", "content": QUESTION},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": json.dumps(CALL_ARGUMENTS)},
    {"type": "function_call_output", "call_id": "call_1", "output": TOOL_RESULT}]


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
@pytest.mark.parametrize("turn", ["call", "answer"])
def test_speculative_equals_plain_token_for_token_with_tools(server, path, turn):
    if path == "/v1/messages":
        body = {"model": "tiny", "max_tokens": 64, "system": SYSTEM, "tools": [CLAUDE_TOOL],
                "messages": CLAUDE_SECOND_TURN if turn == "answer" else CLAUDE_SECOND_TURN[:1]}
    else:
        body = {"model": "tiny", "max_output_tokens": 64, "instructions": SYSTEM, "tools": [RESPONSES_TOOL],
                "input": RESPONSES_SECOND_TURN if turn == "answer" else RESPONSES_SECOND_TURN[:1]}
    spec = streamed_token_ids(server, path, {**body, "speculative": True})
    plain = streamed_token_ids(server, path, {**body, "speculative": False})
    assert spec == plain and len(spec) > 5


def responses_turns(gpt, stream: bool, **extra) -> tuple:
    """The round trip through the openai SDK's Responses API: (the call's, the answer's)."""
    def send(items):
        request = {"model": "tiny", "max_output_tokens": 64, "instructions": SYSTEM,
                   "tools": [RESPONSES_TOOL], "input": items, **extra}
        if not stream:
            return gpt.responses.create(**request)
        with gpt.responses.stream(**request) as events:
            return events.get_final_response()

    question = [{"role": "user", "content": QUESTION}]
    call = send(question)
    answer = send([*question, *call.output,
                   {"type": "function_call_output", "call_id": call.output[-1].call_id,
                    "output": TOOL_RESULT}])
    return call, answer


@pytest.mark.parametrize("stream", [False, True])
def test_openai_sdk_responses_tool_round_trip(gpt, stream):
    call, answer = responses_turns(gpt, stream)
    assert call.status == "completed"
    assert [item.type for item in call.output] == ["function_call"]
    function_call = call.output[0]
    assert function_call.name == "get_weather" and json.loads(function_call.arguments) == CALL_ARGUMENTS
    assert function_call.call_id.startswith("call_") and function_call.status == "completed"
    assert answer.output_text == ANSWER
    assert [item.type for item in answer.output] == ["message"]


def test_responses_function_call_streams_its_argument_events(gpt):
    events = list(gpt.responses.create(model="tiny", instructions=SYSTEM, tools=[RESPONSES_TOOL],
                                       input=QUESTION, max_output_tokens=64, stream=True))
    kinds = [e.type for e in events if e.type != "response.in_progress"]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert kinds[1] == "response.output_item.added" and events[-1].response.output[0].type == "function_call"
    assert kinds[-3:-1] == ["response.function_call_arguments.done", "response.output_item.done"]
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(pieces) == json.loads(done.arguments) == CALL_ARGUMENTS
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_every_api_gives_chats_call_and_answer(gpt, claude):
    chat = gpt.chat.completions.create(model="tiny", max_tokens=64, messages=first_turn(),
                                       tools=[WEATHER_TOOL])
    chat_call = chat.choices[0].message.tool_calls[0]
    claude_call, claude_answer = claude_turns(claude, False)
    responses_call, responses_answer = responses_turns(gpt, False)
    assert json.loads(chat_call.function.arguments) == claude_call.content[0].input == \
        json.loads(responses_call.output[0].arguments)
    second = gpt.chat.completions.create(model="tiny", max_tokens=64, tools=[WEATHER_TOOL], messages=[
        *first_turn(), {"role": "assistant", "content": None,
                        "tool_calls": [chat_call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": chat_call.id, "content": TOOL_RESULT}])
    assert second.choices[0].message.content == claude_answer.content[0].text == \
        responses_answer.output_text
    assert chat.usage.completion_tokens == claude_call.usage.output_tokens == \
        responses_call.usage.output_tokens


# Codex's request shape: its tools grouped in a namespace, built-in tools it sends whatever the
# provider, a reasoning summary asked for. The namespace's empty description and the left-out
# built-ins leave the prompt the agent target memorized.
CODEX_TOOLS = [{"type": "namespace", "name": "weather", "description": "", "tools": [RESPONSES_TOOL]},
               {"type": "web_search", "external_web_access": False},
               {"type": "tool_search", "execution": "client", "description": "Find tools."}]
CODEX_SETTINGS = {"tools": CODEX_TOOLS, "reasoning": {"summary": "auto"}, "parallel_tool_calls": False,
                  "include": ["reasoning.encrypted_content"], "prompt_cache_key": "thread-1"}


@pytest.mark.parametrize("stream", [False, True])
def test_a_codex_shaped_request_calls_the_namespaced_tool_and_gets_its_answer(gpt, stream):
    call, answer = responses_turns(gpt, stream, **CODEX_SETTINGS)
    plain_call, plain_answer = responses_turns(gpt, False)
    assert [item.type for item in call.output] == ["function_call"]
    function_call = call.output[0]
    assert function_call.namespace == "weather"  # how Codex routes the call back
    assert function_call.name == "get_weather" and json.loads(function_call.arguments) == CALL_ARGUMENTS
    assert answer.output_text == plain_answer.output_text == ANSWER
    assert call.usage.input_tokens == plain_call.usage.input_tokens  # the same prompt
    notes = call.model_extra["dflash_notes"]
    assert any(note.startswith("tools.1: 'web_search' left out") for note in notes), notes
    assert any(note.startswith("tools.2: 'tool_search' left out") for note in notes), notes
    assert any(note.startswith("reasoning.summary 'auto'") for note in notes), notes


APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
               "format": {"type": "grammar", "syntax": "lark",
                          "definition": 'start: "*** Begin Patch" LF hunk* "*** End Patch"\nhunk: /.+/ LF\n%import common.LF'}}


def test_codex_s_custom_tool_is_offered_and_its_grammar_noted(gpt):
    with_patch = gpt.responses.create(model="tiny", instructions=SYSTEM, input=QUESTION, max_output_tokens=1,
                                      **{**CODEX_SETTINGS, "tools": [*CODEX_TOOLS, APPLY_PATCH]})
    without = gpt.responses.create(model="tiny", instructions=SYSTEM, input=QUESTION, max_output_tokens=1,
                                   **CODEX_SETTINGS)
    assert with_patch.usage.input_tokens > without.usage.input_tokens  # in the prompt, grammar and all
    assert "tools.3.format: the lark grammar of custom tool 'apply_patch' is shown to the model, " \
           "not enforced" in with_patch.model_extra["dflash_notes"]
