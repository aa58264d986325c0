"""A chat template's own refusal is the request's, on all three APIs: a 400 in each API's error
shape with the template's message, never a 500; and OpenAI's documented tool turn (an assistant
message with `content: null` and `tool_calls`, then the `tool` result) renders under a template
that writes every message's content as text (SmolLM2's, the embedded target's, does)."""

from __future__ import annotations

import httpx
import pytest
from service_support import assert_openai_error, make_pair, start_service

ALTERNATE = "Conversation roles must alternate user/assistant/user/assistant/..."
# SmolLM2-Instruct's template (content joined with +), with Mistral's and Gemma's alternation check
TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.index0 > 0 and message['role'] == 'user' and messages[loop.index0 - 1]['role'] == 'user' %}"
    "{{ raise_exception('" + ALTERNATE + "') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TWO_USERS = [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hello?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from transformers import AutoTokenizer

    target, drafter = make_pair(tmp_path_factory.mktemp("pair"))
    tokenizer = AutoTokenizer.from_pretrained(target)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(target)
    _state, server = start_service(target, drafter)
    yield server
    server.stop()


def test_chat_completions_answers_a_template_refusal_with_400(server):
    refused = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                         json={"model": "tiny", "messages": TWO_USERS, "max_tokens": 4})
    assert ALTERNATE in assert_openai_error(refused, 400, "invalid_request")["message"]


def test_responses_answers_a_template_refusal_with_400(server):
    refused = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "model": "tiny", "max_output_tokens": 4,
        "input": [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hello?"}]})
    assert ALTERNATE in assert_openai_error(refused, 400, "invalid_request")["message"]


def test_messages_answers_a_template_refusal_with_400_in_anthropic_shape(server):
    refused = httpx.post(server.url + "/v1/messages", timeout=60,
                         json={"model": "tiny", "max_tokens": 4, "messages": TWO_USERS})
    assert refused.status_code == 400, refused.text
    body = refused.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert ALTERNATE in body["error"]["message"]


def test_openai_documented_tool_turn_renders(server):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    content_left_out = [messages[0], {k: v for k, v in messages[1].items() if k != "content"},
                        messages[2]]
    for turn in (messages, content_left_out):
        reply = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": turn, "max_tokens": 4})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["role"] == "assistant"
