"""Structured output through every API, with the official SDKs, against the real service on a
tiny trained target (agent_tiny.py: a hermes template, so strict tools run too): OpenAI chat
`response_format` (`chat.completions.parse`), Responses `text.format` (`responses.parse`),
Anthropic `output_config.format`, our `structured_outputs` regex and Lark grammar, strict tools
and a custom tool's regex, and `finish_reason: "length"` when max_tokens cuts a constrained reply.

The target was trained for another reply (a weather call): what it writes here comes from the
grammar's mask alone, which is the point: every reply validates although the model would not
write it. The schemas bound every value (enums, booleans, small integers, short strings), so a
random-ish model finishes well inside max_tokens.
"""

from __future__ import annotations

import json
import re
from typing import Literal

import anthropic
import httpx
import openai
import pytest
from agent_tiny import AGENT_TOOLS, agent_pair, first_turn
from pydantic import BaseModel, Field
from service_support import assert_openai_error, openai_client, serve_module


class Weather(BaseModel):
    city: Literal["Paris", "London", "Tokyo"]
    sunny: bool
    celsius: int = Field(ge=-20, le=45)


class Note(BaseModel):
    text: str = Field(max_length=12)


def closed_schema(model: type[BaseModel]) -> dict:
    """The model's schema without room for other keys (what the SDKs' parse helpers send)."""
    return {**model.model_json_schema(), "additionalProperties": False}


CALL_TOKENS = 200  # the tiny tokenizer is byte-level: a call is about a token per character
QUESTION = [{"role": "user", "content": "weather in Paris?"}]
STRICT_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city", "strict": True,
    "parameters": {"type": "object", "additionalProperties": False, "required": ["town", "days"],
                   "properties": {"town": {"enum": ["Lyon", "Nice"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 3}}}}}


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    pair = agent_pair(tmp_path_factory)
    yield from serve_module(tmp_path_factory, (pair.target, pair.drafter))


@pytest.fixture(scope="module")
def client(service):
    return openai_client(service[1])


def post(service, path: str, body: dict) -> httpx.Response:
    return httpx.post(service[1].url + path, json={"model": "tiny", **body}, timeout=120)


@pytest.mark.parametrize("speculative", [True, False])
def test_chat_parse_returns_the_pydantic_model(client, speculative):
    reply = client.chat.completions.parse(model="tiny", messages=QUESTION, response_format=Weather,
                                          max_tokens=60, extra_body={"speculative": speculative})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Weather)
    assert Weather.model_validate_json(choice.message.content) == choice.message.parsed


def test_speculative_and_plain_write_the_same_constrained_reply(service):
    body = {"messages": QUESTION, "max_tokens": 60, "response_format": {"type": "json_schema",
            "json_schema": {"name": "weather", "schema": closed_schema(Weather)}}}
    texts = [post(service, "/v1/chat/completions", {**body, "speculative": speculative}).json()
             ["choices"][0]["message"]["content"] for speculative in (True, False)]
    assert texts[0] == texts[1]
    Weather.model_validate_json(texts[0])


def test_a_streamed_constrained_reply_is_the_whole_one(client):
    kwargs = {"model": "tiny", "messages": QUESTION, "max_tokens": 60, "response_format": {
        "type": "json_schema", "json_schema": {"name": "weather", "schema": closed_schema(Weather)}}}
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "stop"
    Weather.model_validate_json(whole)


def test_a_reply_cut_by_max_tokens_says_length(client):
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(model="tiny", messages=QUESTION, response_format=Weather,
                                      max_tokens=3)
    reply = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=3,
                                           response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason == "length"


def test_responses_parse_returns_the_pydantic_model(client):
    response = client.responses.parse(model="tiny", input="weather in Paris?", text_format=Weather,
                                      max_output_tokens=60)
    assert isinstance(response.output_parsed, Weather)
    assert response.text.format.type == "json_schema"


def test_anthropic_output_config_format(service):
    claude = anthropic.Anthropic(base_url=service[1].url, api_key="unused", max_retries=0)
    schema = closed_schema(Note)
    message = claude.messages.create(model="tiny", max_tokens=60, messages=QUESTION,
                                     output_config={"format": {"type": "json_schema", "schema": schema}})
    assert message.stop_reason == "end_turn"
    Note.model_validate_json(message.content[0].text)


@pytest.mark.parametrize(("grammar", "matches"), [
    ({"regex": r"(yes|no), [0-9]{2}"}, lambda text: re.fullmatch(r"(yes|no), [0-9]{2}", text)),
    ({"grammar": 'start: "<" item ("," item)* ">"\nitem: /[a-c]{1,3}/'},
     lambda text: re.fullmatch(r"<[a-c]{1,3}(,[a-c]{1,3})*>", text)),
])
def test_structured_outputs_regex_and_lark(service, grammar, matches):
    reply = post(service, "/v1/chat/completions",
                 {"messages": QUESTION, "max_tokens": 40, "structured_outputs": grammar}).json()
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert matches(choice["message"]["content"]), choice["message"]["content"]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_strict_call_follows_its_schema(client, tool_choice):
    # the target learned {"city": "Paris"}: the strict schema asks for a town and days instead
    reply = client.chat.completions.create(model="tiny", messages=first_turn(), tools=[STRICT_WEATHER],
                                           tool_choice=tool_choice, max_tokens=CALL_TOKENS)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"town", "days"} and arguments["town"] in ("Lyon", "Nice")
    assert 1 <= arguments["days"] <= 3


def test_a_strict_call_under_tool_choice_auto_follows_its_schema(client):
    reply = client.chat.completions.create(model="tiny", messages=first_turn(), tools=[STRICT_WEATHER],
                                           max_tokens=CALL_TOKENS)
    for call in reply.choices[0].message.tool_calls or ():
        assert set(json.loads(call.function.arguments)) == {"town", "days"}
    unconstrained = client.chat.completions.create(model="tiny", messages=first_turn(),
                                                   tools=AGENT_TOOLS, max_tokens=CALL_TOKENS)
    assert json.loads(unconstrained.choices[0].message.tool_calls[0].function.arguments) == {"city": "Paris"}


def test_a_custom_tools_regex_is_its_inputs_pattern(service):
    tool = {"type": "custom", "name": "digits", "description": "Digits only",
            "format": {"type": "grammar", "syntax": "regex", "definition": "[0-9]{3}-[0-9]{2}"}}
    reply = post(service, "/v1/responses", {"input": "weather in Paris?", "tools": [tool],
                                            "tool_choice": "required", "max_output_tokens": CALL_TOKENS}).json()
    (call,) = [item for item in reply["output"] if item["type"] == "custom_tool_call"]
    assert re.fullmatch("[0-9]{3}-[0-9]{2}", call["input"]), call


@pytest.mark.parametrize(("path", "body", "words"), [
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                          "schema": {"type": "objectz"}}}},
     ["text.format.schema", "objectz"]),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "dependentSchemas": {}}}}}]},
     ["tools.0", "parameters (strict)", "dependentSchemas"]),
    ("/v1/messages", {"max_tokens": 5, "messages": QUESTION, "output_config": {"format": {
        "type": "json_schema", "schema": {"type": "object", "if": {}}}}},
     ["output_config.format.schema", "if"]),
    ("/v1/messages", {"max_tokens": 5, "messages": QUESTION, "output_format": {
        "type": "json_schema", "schema": {"type": "object"}}, "output_config": {"format": {
            "type": "json_schema", "schema": {"type": "object"}}}},
     ["output_config.format", "output_format", "give one"]),
])
def test_each_apis_bad_constraint_is_a_400_naming_its_field(service, path, body, words):
    response = post(service, path, body)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert all(word in message for word in words), message


def test_nothing_is_queued_for_a_refused_constraint(service):
    state = service[0]
    done = state.loaded.worker.jobs_done
    response = post(service, "/v1/chat/completions", {"messages": QUESTION, "structured_outputs": {
        "regex": "[^\\s\\S]"}})
    assert_openai_error(response, 400, "invalid_request")
    assert state.loaded.worker.jobs_done == done


def test_a_legacy_completion_follows_structured_outputs(service):
    reply = post(service, "/v1/completions", {"prompt": "The answer:", "max_tokens": 20,
                                              "structured_outputs": {"regex": "(yes|no)!"}}).json()
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] in ("yes!", "no!"), choice
