"""A request's counts are capped, each refused with a 400 that names the field, the count and
the cap, in the shape of the API it came through (the real openai and anthropic SDKs against the
real server): messages, tools and stop strings on chat completions and /v1/messages, input items
and tools on /v1/responses, content blocks per Anthropic message. At the cap a request passes."""

from __future__ import annotations

import anthropic
import openai
import pytest

from dflash_local.service.anthropic_messages_schemas import MAX_CONTENT_BLOCKS
from dflash_local.service.request_fields import MAX_MESSAGES, MAX_STOP_STRINGS, MAX_TOOLS

EMPTY = {"role": "user", "content": ""}
TOOL = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}
CLAUDE_TOOL = {"name": "noop", "input_schema": {"type": "object"}}


@pytest.fixture(scope="module")
def claude(served):
    return anthropic.Anthropic(base_url=served[1].url, api_key="unused", max_retries=0)


@pytest.mark.parametrize(("field", "body", "message"), [
    ("messages", {"messages": [EMPTY] * (MAX_MESSAGES + 1)},
     f"messages: at most {MAX_MESSAGES} messages per request, got {MAX_MESSAGES + 1}"),
    ("tools", {"messages": [EMPTY], "tools": [TOOL] * (MAX_TOOLS + 1)},
     f"tools: at most {MAX_TOOLS} tools per request, got {MAX_TOOLS + 1}"),
    ("stop", {"messages": [EMPTY], "stop": ["x"] * (MAX_STOP_STRINGS + 1)},
     f"stop: at most {MAX_STOP_STRINGS} stop strings per request, got {MAX_STOP_STRINGS + 1}"),
])
def test_chat_counts_are_capped_in_openais_shape(gpt, field, body, message):
    with pytest.raises(openai.BadRequestError) as refused:
        gpt.chat.completions.create(model="tiny", max_tokens=1, **body)
    error = refused.value.response.json()["error"]
    assert error == {"message": message, "type": "invalid_request_error", "param": field,
                     "code": "invalid_request"}


@pytest.mark.parametrize(("body", "message"), [
    ({"messages": [EMPTY] * (MAX_MESSAGES + 1)},
     f"messages: at most {MAX_MESSAGES} messages per request, got {MAX_MESSAGES + 1}"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * (MAX_CONTENT_BLOCKS + 1)}]},
     (f"messages.0.content: at most {MAX_CONTENT_BLOCKS} content blocks per message, "
     f"got {MAX_CONTENT_BLOCKS + 1}")),
    ({"messages": [EMPTY], "tools": [CLAUDE_TOOL] * (MAX_TOOLS + 1)},
     f"tools: at most {MAX_TOOLS} tools per request, got {MAX_TOOLS + 1}"),
    ({"messages": [EMPTY], "stop_sequences": ["x"] * (MAX_STOP_STRINGS + 1)},
     (f"stop_sequences: at most {MAX_STOP_STRINGS} stop strings per request, "
     f"got {MAX_STOP_STRINGS + 1}")),
])
def test_messages_counts_are_capped_in_anthropics_shape(claude, body, message):
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model="tiny", max_tokens=1, **body)
    assert refused.value.response.json() == {
        "type": "error", "error": {"type": "invalid_request_error", "message": message}}


@pytest.mark.parametrize(("field", "body", "message"), [
    ("input", {"input": [EMPTY] * (MAX_MESSAGES + 1)},
     f"input: at most {MAX_MESSAGES} input items per request, got {MAX_MESSAGES + 1}"),
    ("tools", {"input": "hi", "tools": [{"type": "function", "name": "noop"}] * (MAX_TOOLS + 1)},
     f"tools: at most {MAX_TOOLS} tools per request, got {MAX_TOOLS + 1}"),
])
def test_responses_counts_are_capped_in_openais_shape(gpt, field, body, message):
    with pytest.raises(openai.BadRequestError) as refused:
        gpt.responses.create(model="tiny", max_output_tokens=1, **body)
    error = refused.value.response.json()["error"]
    assert (error["message"], error["param"], error["type"]) == (
        message, field, "invalid_request_error")


def test_a_conversation_at_the_cap_passes_the_count(gpt):
    """MAX_MESSAGES messages reach the template: the tiny target's short context refuses them."""
    with pytest.raises(openai.BadRequestError) as refused:
        gpt.chat.completions.create(model="tiny", max_tokens=1, messages=[EMPTY] * MAX_MESSAGES)
    error = refused.value.response.json()["error"]
    assert error["code"] == "context_length_exceeded", error
