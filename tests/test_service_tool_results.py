"""A tool result must answer a call made earlier in the conversation: on chat, Responses and
Messages alike, one that answers none (an unknown id, or the call only after it) is a 400 naming
the field and the id, in each API's error shape. Validation runs before a pair is needed, so the
server here has none: a request that passes gets 503 "no pair loaded", never a 400."""

from __future__ import annotations

import httpx
import pytest

USER = {"role": "user", "content": "Weather?"}
ARGS = '{"city": "Paris"}'


def chat(call_id: str, answered: str, call_first: bool = True) -> dict:
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "w", "arguments": ARGS}}]}
    result = {"role": "tool", "tool_call_id": answered, "content": "sunny"}
    turns = [call, result] if call_first else [result, call]
    return {"model": "tiny", "max_tokens": 4, "messages": [USER, *turns]}


def responses(call_id: str, answered: str, call_first: bool = True) -> dict:
    call = {"type": "function_call", "call_id": call_id, "name": "w", "arguments": ARGS}
    result = {"type": "function_call_output", "call_id": answered, "output": "sunny"}
    items = [call, result] if call_first else [result, call]
    return {"model": "tiny", "max_output_tokens": 4, "input": [USER, *items]}


def messages(call_id: str, answered: str, call_first: bool = True) -> dict:
    call = {"role": "assistant", "content": [
        {"type": "tool_use", "id": call_id, "name": "w", "input": {"city": "Paris"}}]}
    result = {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": answered, "content": "sunny"}]}
    turns = [call, result] if call_first else [USER, result, call, USER]
    return {"model": "tiny", "max_tokens": 4, "messages": [USER, *turns]}


APIS = {  # path, body builder, the field a result names its call in
    "chat": ("/v1/chat/completions", chat, "messages.2.tool_call_id"),
    "responses": ("/v1/responses", responses, "input.2.call_id"),
    "messages": ("/v1/messages", messages, "messages.2.content.0.tool_use_id"),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from dflash_local.service.app import create_app
    from dflash_local.service.server import BackgroundServer
    from dflash_local.service.state import ServiceState

    state = ServiceState(hub_cache_dir=tmp_path_factory.mktemp("hub"))
    with BackgroundServer(create_app(state)) as running:
        yield running


def error_of(response: httpx.Response, api: str) -> dict:
    body = response.json()
    if api == "messages":
        assert body["type"] == "error", body
        assert body["error"]["type"] == "invalid_request_error", body
    else:
        assert body["error"]["code"] == "invalid_request", body
    return body["error"]


@pytest.mark.parametrize("api", list(APIS))
def test_a_result_for_an_unknown_call_is_a_400_naming_it(server, api):
    path, body, field = APIS[api]
    response = httpx.post(server.url + path, json=body("call_1", "call_9"), timeout=30)
    assert response.status_code == 400, response.text
    message = error_of(response, api)["message"]
    assert field in message and "'call_9'" in message and "answers no" in message, message
    assert "'call_1'" in message, message  # the ids it could have answered


@pytest.mark.parametrize("api", list(APIS))
def test_a_result_before_its_call_is_a_400(server, api):
    path, body, _field = APIS[api]
    response = httpx.post(server.url + path, json=body("call_1", "call_1", call_first=False),
                          timeout=30)
    assert response.status_code == 400, response.text
    assert "'call_1' answers no" in error_of(response, api)["message"]


@pytest.mark.parametrize("api", list(APIS))
def test_a_result_answering_its_call_passes_validation(server, api):
    path, body, _field = APIS[api]
    response = httpx.post(server.url + path, json=body("call_1", "call_1"), timeout=30)
    assert response.status_code == 503, response.text  # no pair loaded: validation passed
