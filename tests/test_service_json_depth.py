"""JSON nested past the cap is a 400 that names the depth, on every free-form field of every
API, before anything recurses into it (700 deep was a RecursionError: a 500; 5,000 deep a vague
parse error); a body that is not UTF-8 is a 400 that says so."""

from __future__ import annotations

import json

import httpx
import pytest
from service_support import assert_openai_error, serve_module

DEEP = 700  # past the cap, short of the parser's own limit: recursion happened after parsing
USER = {"role": "user", "content": "Hi"}


def nested(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


def body_with(free_form: str, shape: str) -> bytes:
    """`shape` is a request's JSON with FREE where the deep value goes."""
    return shape.replace('"FREE"', free_form).encode()


CHAT_TOOL = json.dumps({"model": "tiny", "max_tokens": 4, "messages": [USER], "tools": [
    {"type": "function", "function": {"name": "f", "parameters": "FREE"}}]})
MESSAGES_TOOL_INPUT = json.dumps({"model": "tiny", "max_tokens": 4, "messages": [
    USER, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",
                                             "input": "FREE"}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]})
RESPONSES_TOOL = json.dumps({"model": "tiny", "max_output_tokens": 4, "input": "Hi", "tools": [
    {"type": "function", "name": "f", "parameters": "FREE"}]})
CASES = {
    "chat tool schema": ("/v1/chat/completions", CHAT_TOOL),
    "messages tool input": ("/v1/messages", MESSAGES_TOOL_INPUT),
    "responses tool schema": ("/v1/responses", RESPONSES_TOOL),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    for _state, server in serve_module(tmp_path_factory):
        yield server


def post(server, path: str, content: bytes) -> httpx.Response:
    return httpx.post(server.url + path, content=content, timeout=60,
                      headers={"Content-Type": "application/json"})


def error_message(response: httpx.Response, path: str) -> str:
    assert response.status_code == 400, (response.status_code, response.text)
    if path == "/v1/messages":
        return response.json()["error"]["message"]
    return assert_openai_error(response, 400, "invalid_request")["message"]


@pytest.mark.parametrize("depth", [DEEP, 5000])
@pytest.mark.parametrize("case", list(CASES))
def test_deep_free_form_json_is_refused_naming_the_depth(server, case, depth):
    path, shape = CASES[case]
    message = error_message(post(server, path, body_with(nested(depth), shape)), path)
    assert "levels deep" in message and "at most 100" in message, message


@pytest.mark.parametrize("depth", [DEEP, 5000])
@pytest.mark.parametrize("path,shape", [
    ("/v1/chat/completions", {"model": "tiny", "max_tokens": 4, "messages": [
        USER, {"role": "assistant", "content": None, "tool_calls": [{
            "id": "c1", "type": "function", "function": {"name": "f", "arguments": "FREE"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}),
    ("/v1/responses", {"model": "tiny", "max_output_tokens": 4, "input": [
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "FREE"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"}]}),
], ids=["chat", "responses"])
def test_deep_arguments_text_is_refused_naming_the_depth(server, path, shape, depth):
    content = json.dumps(shape).replace('"FREE"', json.dumps(nested(depth))).encode()
    message = error_message(post(server, path, content), path)
    assert "levels deep" in message and "at most 100" in message, message


def test_moderate_nesting_is_served(server):
    response = post(server, "/v1/chat/completions", body_with(nested(40), CHAT_TOOL))
    assert response.status_code in (200, 400), response.text
    assert "levels deep" not in response.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
def test_a_body_that_is_not_utf8_is_refused_saying_so(server, path):
    content = json.dumps({"model": "tiny", "max_tokens": 4, "messages": [USER]}).encode()
    content = content.replace(b"Hi", b"H\xff\xfei")
    assert "not valid UTF-8" in error_message(post(server, path, content), path)
