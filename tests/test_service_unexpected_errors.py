"""An unexpected error (a bug, not a refusal) is a 500 in each API's own error shape: OpenAI's
on /v1/chat/completions, Anthropic's on /v1/messages, never a traceback. The fault is scripted
(the engine's templating raises), as a real pair cannot produce a bug on demand."""

from __future__ import annotations

import httpx
import pytest
from service_support import assert_openai_error, serve_module

USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    yield from serve_module(tmp_path_factory)


@pytest.fixture
def broken_engine(service):
    engine = service[0].loaded.engine

    def encode_chat(*args, **kwargs):
        raise RuntimeError("a bug in the engine")

    engine.encode_chat = encode_chat
    yield
    del engine.encode_chat  # the class's own again


def test_a_500_on_chat_completions_is_in_openai_shape(service, broken_engine):
    response = httpx.post(service[1].url + "/v1/chat/completions", timeout=60,
                          json={"model": "tiny", "max_tokens": 4, "messages": USER})
    assert "a bug" not in assert_openai_error(response, 500, "internal_error")["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_500_on_messages_is_in_anthropic_shape(service, broken_engine, stream):
    response = httpx.post(service[1].url + "/v1/messages", timeout=60, json={
        "model": "tiny", "max_tokens": 4, "messages": USER, "stream": stream})
    assert response.status_code == 500, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "api_error", body
    assert "Traceback" not in response.text and "a bug" not in response.text


def test_the_pair_serves_again_after_it(service):
    response = httpx.post(service[1].url + "/v1/messages", timeout=60,
                          json={"model": "tiny", "max_tokens": 4, "messages": USER})
    assert response.status_code == 200, response.text
