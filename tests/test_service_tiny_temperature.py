"""A temperature below 1e-5 is greedy (vLLM's rule), on every API: 1e-320 (which overflows the
logits to NaN when divided by) and 1e-6 answer 200 with the greedy reply, through the real
openai SDK and over /v1/messages."""

from __future__ import annotations

import httpx
import pytest
from service_support import openai_client, serve_module

TINY = (1e-320, 1e-6)
PROMPT = "Say something about seven."


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    yield from serve_module(tmp_path_factory)


def chat_text(client, temperature: float) -> str:
    reply = client.chat.completions.create(model="tiny", max_tokens=12, temperature=temperature,
                                           messages=[{"role": "user", "content": PROMPT}])
    return reply.choices[0].message.content


@pytest.mark.parametrize("temperature", TINY)
def test_chat_completions_takes_a_tiny_temperature_as_greedy(service, temperature):
    client = openai_client(service[1])
    assert chat_text(client, temperature) == chat_text(client, 0.0)


@pytest.mark.parametrize("temperature", TINY)
def test_responses_takes_a_tiny_temperature_as_greedy(service, temperature):
    client = openai_client(service[1])

    def reply(value: float) -> str:
        return client.responses.create(model="tiny", input=PROMPT, max_output_tokens=12,
                                       temperature=value).output_text

    assert reply(temperature) == reply(0.0)


@pytest.mark.parametrize("temperature", TINY)
def test_messages_takes_a_tiny_temperature_as_greedy(service, temperature):
    def reply(value: float) -> str:
        response = httpx.post(service[1].url + "/v1/messages", timeout=60, json={
            "model": "tiny", "max_tokens": 12, "temperature": value,
            "messages": [{"role": "user", "content": PROMPT}]})
        assert response.status_code == 200, response.text
        return response.json()["content"][0]["text"]

    assert reply(temperature) == reply(0.0)
