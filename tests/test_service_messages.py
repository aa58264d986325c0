"""POST /v1/messages end to end: the real server on a tiny random pair, driven by the official
`anthropic` SDK; every reply checked against /v1/chat/completions on the same conversation."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from service_support import EOS_PROMPT, LONG_PROMPT, serve_module

from dflash_local.pairs.catalog import load_catalog
from dflash_local.service.anthropic_messages_schemas import MessagesRequest

KEY = "s3cret"
SYSTEM = "Be brief."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    for _state, server in serve_module(tmp_path_factory, api_key=KEY):
        yield server


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def gpt(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def chat_reply(gpt, prompt: str, max_tokens: int, **extra):
    return gpt.chat.completions.create(
        model="tiny", max_tokens=max_tokens, temperature=0, **extra,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}])


def ask(claude, prompt: str, max_tokens: int, **extra):
    return claude.messages.create(model="tiny", max_tokens=max_tokens, system=SYSTEM,
                                  messages=[{"role": "user", "content": prompt}], **extra)


def test_a_message_is_the_chat_reply_in_anthropic_shape(claude, gpt):
    chat = chat_reply(gpt, LONG_PROMPT, 20)
    message = ask(claude, LONG_PROMPT, 20)
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == chat.choices[0].message.content
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    usage = message.usage
    assert usage.output_tokens == chat.usage.completion_tokens == 20
    # Anthropic counts the cached prefix apart: together they are the whole prompt
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.cache_read_input_tokens > 0  # the chat request above left this prompt cached
    assert usage.model_extra["dflash"]["engine"] == "transformers"


def test_system_as_text_blocks_and_content_as_blocks_read_like_strings(claude):
    as_strings = ask(claude, LONG_PROMPT, 12)
    as_blocks = claude.messages.create(
        model="tiny", max_tokens=12, system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Tell me a "},
                                               {"type": "text", "text": "long story."}]}])
    assert as_blocks.content[0].text == as_strings.content[0].text


def test_end_of_turn_is_end_turn(claude, gpt):
    message = ask(claude, EOS_PROMPT, 64)
    assert message.stop_reason == "end_turn"
    assert message.content[0].text == chat_reply(gpt, EOS_PROMPT, 64).choices[0].message.content
    assert message.usage.output_tokens < 64


def test_streaming_sends_anthropics_events_in_order(claude):
    whole = ask(claude, LONG_PROMPT, 24)
    with claude.messages.stream(model="tiny", max_tokens=24, system=SYSTEM,
                                messages=[{"role": "user", "content": LONG_PROMPT}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type not in ("text", "ping")]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    streamed = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    text_events = "".join(e.text for e in events if e.type == "text")  # the SDK's own text events
    assert streamed == text_events == whole.content[0].text == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 24


def test_every_round_streams_its_dflash_statistics(server):
    body = {"model": "tiny", "max_tokens": 24, "stream": True, "system": SYSTEM,
            "messages": [{"role": "user", "content": LONG_PROMPT}]}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, headers={"x-api-key": KEY},
                      timeout=60) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    events = [json.loads(line.removeprefix("data: ")) for line in lines]
    rounds = [e["dflash"] for e in events if "dflash" in e and e["type"] != "message_delta"]
    assert [r["round"] for r in rounds] == list(range(len(rounds)))
    assert sum(len(r["token_ids"]) for r in rounds) == 24
    final = next(e for e in events if e["type"] == "message_delta")
    assert final["usage"]["dflash"]["rounds"] == len(rounds) - 1  # the prefill is not a round


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_sequence_ends_the_reply_and_is_named(claude, gpt, stream):
    text = chat_reply(gpt, LONG_PROMPT, 30).choices[0].message.content
    stop = text[10:14]
    before = text[: text.index(stop)]
    request = {"model": "tiny", "max_tokens": 30, "system": SYSTEM, "stop_sequences": ["\x00never", stop],
               "messages": [{"role": "user", "content": LONG_PROMPT}]}
    if stream:
        with claude.messages.stream(**request) as events:
            message = events.get_final_message()
    else:
        message = claude.messages.create(**request)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == before


def test_speculative_equals_plain(claude):
    spec = ask(claude, LONG_PROMPT, 32, extra_body={"speculative": True})
    plain = ask(claude, LONG_PROMPT, 32, extra_body={"speculative": False})
    assert spec.content[0].text == plain.content[0].text
    assert spec.usage.model_extra["dflash"]["block_size"] == 8
    assert plain.usage.model_extra["dflash"]["block_size"] == 1


def test_the_key_is_accepted_as_x_api_key_or_bearer(server):
    by_bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0)
    assert ask(by_bearer, EOS_PROMPT, 4).usage.output_tokens == 4
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        ask(wrong, EOS_PROMPT, 4)
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "authentication_error"


def test_the_guards_errors_take_anthropics_shape_too(server):
    response = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY, "Host": "evil.example"},
                          json={"model": "tiny", "max_tokens": 4, "messages": HI}, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert "evil.example" in response.json()["error"]["message"]
    assert int(response.headers["content-length"]) == len(response.content)


def test_another_known_pair_is_anthropics_not_found(claude):
    # any other name is served by the loaded pair (test_service_claude_code.py)
    other = load_catalog().pairs[0].id
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude.messages.create(model=other, max_tokens=4,
                               messages=[{"role": "user", "content": "Hi"}])
    assert other in caught.value.body["error"]["message"]


HI = [{"role": "user", "content": "Hi"}]
OBJECT = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOL = {"name": "get_weather", "description": "Weather in a city", "input_schema": OBJECT}
CALL = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                          "input": {"city": "Paris"}}]}
BAD = {
    "content with no blocks": ({"messages": [{"role": "user", "content": []}]},
                               ["messages.0.content", "neither text nor tool blocks"]),
    "only a thinking block": ({"messages": [*HI, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hmm", "signature": "x"}]}]},
        ["messages.1.content", "neither text nor tool blocks"]),
    "a thinking block from the user": ({"messages": [{"role": "user", "content": [
        {"type": "thinking", "thinking": "hmm"}, {"type": "text", "text": "Hi"}]}]},
        ["messages.0.content.0", "assistant"]),
    "an image block": ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
        ["messages.0.content.0", "image"]),
    "no max_tokens": ({"max_tokens": None}, ["max_tokens"]),
    "no model": ({"model": None}, ["model"]),
    "a tool schema that is not an object": ({"tools": [{**TOOL, "input_schema": {"type": "string"}}]},
                                            ["tools.0.input_schema", "object"]),
    "a server tool": ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
                      ["tools.0.type", "web_search_20250305"]),
    "tool_choice naming an unknown tool": ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "nope"}},
                                           ["tool_choice.name", "nope"]),
    "tool_choice any without tools": ({"tool_choice": {"type": "any"}}, ["tool_choice", "needs tools"]),
    "a tool_result answering no call": ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "sunny"}]}]},
        ["messages.0.content.0.tool_use_id", "toolu_9"]),
    "a tool_result without its id": ({"messages": [*HI, CALL, {"role": "user", "content": [
        {"type": "tool_result", "content": "sunny"}]}]}, ["messages.2.content.0", "tool_use_id"]),
    "a tool_use from the user": ({"messages": [{**CALL, "role": "user"}]},
                                 ["messages.0.content.0", "assistant"]),
    "tools for a template without them": ({"tools": [TOOL]}, ["tools", "no tool support"]),
    "temperature over 1": ({"temperature": 1.5}, ["temperature", "1.5"]),
    "a role Anthropic lacks": ({"messages": [{"role": "developer", "content": "x"}]}, ["messages.0.role"]),
    "a tool block in a system turn": ({"messages": [*HI, {"role": "system", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}]},
        ["messages.1.content.0", "user message"]),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_input_is_a_400_naming_the_field(server, case):
    fields, words = BAD[case]
    body = {"model": "tiny", "max_tokens": 4, "messages": HI, **fields}
    body = {name: value for name, value in body.items() if value is not None}
    response = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    for word in words:
        assert word in error["error"]["message"], (word, error)


def test_tool_blocks_become_the_templates_tool_calls_and_tool_messages():
    body = MessagesRequest.model_validate({
        "model": "tiny", "max_tokens": 8, "system": "Use tools.", "tools": [TOOL],
        "tool_choice": {"type": "any"},
        "messages": [{"role": "user", "content": "Weather in Paris?"},
                     {"role": "assistant", "content": [
                         {"type": "thinking", "thinking": "The user wants weather.", "signature": "c2ln"},
                         {"type": "text", "text": "Checking."}, *CALL["content"]]},
                     {"role": "user", "content": [
                         {"type": "tool_result", "tool_use_id": "toolu_1",
                          "content": [{"type": "text", "text": "sunny, 21 C"}]},
                         {"type": "text", "text": "Thanks."}]}]})
    assert body.template_messages() == [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 21 C"},
        {"role": "user", "content": "Thanks."}]
    assert body.job_tools() == ({"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city", "parameters": OBJECT}},)
    assert body.job_tool_choice() == "required"


def test_no_pair_loaded_is_a_503_in_each_apis_shape(tmp_path):
    from service_support import torch_loader

    from dflash_local.service.app import create_app
    from dflash_local.service.server import BackgroundServer
    from dflash_local.service.state import ServiceState

    empty = BackgroundServer(create_app(ServiceState(loader=torch_loader, hub_cache_dir=tmp_path))).start()
    try:
        messages = httpx.post(empty.url + "/v1/messages", timeout=60,
                              json={"model": "tiny", "max_tokens": 4, "messages": HI})
        responses = httpx.post(empty.url + "/v1/responses", json={"input": "Hi"}, timeout=60)
    finally:
        empty.stop()
    assert messages.status_code == responses.status_code == 503
    assert messages.headers["retry-after"] == responses.headers["retry-after"] == "1"
    assert messages.json()["error"]["type"] == "overloaded_error"
    assert "no model is loaded" in messages.json()["error"]["message"]
    assert responses.json()["error"]["code"] == "model_not_loaded"


def test_replies_and_events_validate_as_the_sdks_types(server):
    # the SDK builds its objects without validation: validate strictly, every required field
    from anthropic.types import Message, RawMessageStreamEvent
    from pydantic import TypeAdapter

    body = {"model": "tiny", "max_tokens": 12, "system": SYSTEM, "messages": [{"role": "user", "content": EOS_PROMPT}]}
    headers = {"x-api-key": KEY}
    Message.model_validate(httpx.post(server.url + "/v1/messages", json=body, headers=headers, timeout=60).json())
    with httpx.stream("POST", server.url + "/v1/messages", json={**body, "stream": True}, headers=headers,
                      timeout=60) as response:
        events = [json.loads(line.removeprefix("data: ")) for line in response.iter_lines()
                  if line.startswith("data: ")]
    events = [e for e in events if e["type"] != "ping"]  # not in the SDK's union; its stream skips them
    adapter = TypeAdapter(RawMessageStreamEvent)
    assert [adapter.validate_python(e).type for e in events] == [e["type"] for e in events]


def test_an_error_after_the_stream_began_is_anthropics_error_event():
    from anthropic.types import ErrorResponse

    from dflash_local.service.anthropic_messages import MessagesEncoder

    sent = MessagesEncoder("msg_1", "tiny").failed(503, "the generation was cancelled", "cancelled").decode()
    name, data = sent.strip().split("\n")
    assert name == "event: error"
    error = ErrorResponse.model_validate(json.loads(data.removeprefix("data: ")))
    assert error.error.type == "overloaded_error" and error.error.message == "the generation was cancelled"
