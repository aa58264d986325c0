"""Bad input, each kind its own case: an OpenAI-style error with the right status, never a 500."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from service_support import assert_openai_error, make_pair, start_service

USER = [{"role": "user", "content": "Hi"}]
CHAT = "/v1/chat/completions"
THIS_FILE = os.path.relpath(Path(__file__))  # an existing relative path with a '/'


def chat(**fields):
    return ("POST", CHAT, {"json": {"messages": USER, "max_tokens": 4, **fields}})


def chat_without(*keys, **fields):
    body = {"messages": USER, "max_tokens": 4, **fields}
    return ("POST", CHAT, {"json": {k: v for k, v in body.items() if k not in keys}})


BAD_REQUESTS = {
    # body shape
    "malformed json": (("POST", CHAT, {"content": b'{"messages": [', "headers": {
        "content-type": "application/json"}}), 400, "invalid_request"),
    "body is a list": (("POST", CHAT, {"json": [USER]}), 400, "invalid_request"),
    "empty body": (("POST", CHAT, {"content": b"", "headers": {
        "content-type": "application/json"}}), 400, "invalid_request"),
    "not json content type": (("POST", CHAT, {"content": b"hello", "headers": {
        "content-type": "text/plain"}}), 400, "invalid_request"),
    # messages
    "missing messages": (chat_without("messages"), 400, "invalid_request"),
    "empty messages": (chat(messages=[]), 400, "invalid_request"),
    "messages not a list": (chat(messages="Hi"), 400, "invalid_request"),
    "message not an object": (chat(messages=["Hi"]), 400, "invalid_request"),
    "missing role": (chat(messages=[{"content": "Hi"}]), 400, "invalid_request"),
    "bad role": (chat(messages=[{"role": "wizard", "content": "Hi"}]), 400, "invalid_request"),
    "tool role": (chat(messages=[{"role": "tool", "content": "Hi"}]), 400, "invalid_request"),
    "missing content": (chat(messages=[{"role": "user"}]), 400, "invalid_request"),
    "non-string content": (chat(messages=[{"role": "user", "content": 42}]), 400, "invalid_request"),
    "null content": (chat(messages=[{"role": "user", "content": None}]), 400, "invalid_request"),
    "image content part": (chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400, "invalid_request"),
    "prompt longer than the context": (chat(messages=[{"role": "user", "content": "x" * 3000}]),
                                       400, "context_length_exceeded"),
    # max_tokens
    "negative max_tokens": (chat(max_tokens=-5), 400, "invalid_request"),
    "zero max_tokens": (chat(max_tokens=0), 400, "invalid_request"),
    "huge max_tokens": (chat(max_tokens=10**12), 400, "invalid_request"),
    "max_tokens past the context": (chat(max_tokens=5000), 400, "context_length_exceeded"),
    "string max_tokens": (chat(max_tokens="10"), 400, "invalid_request"),
    "float max_tokens": (chat(max_tokens=1.5), 400, "invalid_request"),
    "max_tokens disagrees": (chat(max_completion_tokens=5), 400, "invalid_request"),
    # sampling
    "negative temperature": (chat(temperature=-0.1), 400, "invalid_request"),
    "temperature above 2": (chat(temperature=2.5), 400, "invalid_request"),
    "string temperature": (chat(temperature="hot"), 400, "invalid_request"),
    "top_p zero": (chat(top_p=0), 400, "invalid_request"),
    "top_p above 1": (chat(top_p=1.5), 400, "invalid_request"),
    "negative seed": (chat(seed=-1), 400, "invalid_request"),
    "n above 1": (chat(n=2), 400, "invalid_request"),
    # stop
    "numeric stop": (chat(stop=7), 400, "invalid_request"),
    "empty stop string": (chat(stop=[""]), 400, "invalid_request"),
    "too many stops": (chat(stop=[str(i) for i in range(9)]), 400, "invalid_request"),
    # streaming
    "string stream": (chat(stream="yes"), 400, "invalid_request"),
    "stream_options without stream": (chat(stream_options={"include_usage": True}), 400,
                                      "invalid_request"),
    "bad stream_options": (chat(stream=True, stream_options={"include_usage": "yes"}), 400,
                           "invalid_request"),
    # thinking and DFlash extensions
    "string thinking": (chat(thinking="on"), 400, "invalid_request"),
    "string enable_thinking": (chat(chat_template_kwargs={"enable_thinking": "no"}), 400,
                               "invalid_request"),
    "thinking disagrees": (chat(thinking=True, chat_template_kwargs={"enable_thinking": False}),
                           400, "invalid_request"),
    "block_size 0": (chat(block_size=0), 400, "invalid_request"),
    "block_size huge": (chat(block_size=100_000), 400, "invalid_request"),
    "block_size word": (chat(block_size="fast"), 400, "invalid_request"),
    "block_size numeric string": (chat(block_size="4"), 400, "invalid_request"),
    "prompt_lookup word": (chat(prompt_lookup="yes"), 400, "invalid_request"),
    "string speculative": (chat(speculative="yes"), 400, "invalid_request"),
    # model names
    "unknown model": (chat(model="gpt-4o"), 404, "model_not_found"),
    "absolute path model": (chat(model="/etc/passwd"), 400, "invalid_request"),
    "parent path model": (chat(model="models/../../etc"), 400, "invalid_request"),
    "home path model": (chat(model="~/models/x"), 400, "invalid_request"),
    "windows path model": (chat(model="C:\\models\\x"), 400, "invalid_request"),
    "existing relative path model": (chat(model=THIS_FILE), 400, "invalid_request"),
    "numeric model": (chat(model=123), 400, "invalid_request"),
    # management
    "load unknown pair": (("POST", "/dflash/load", {"json": {"pair": "no-such-pair"}}), 404,
                          "model_not_found"),
    "load a path as target": (("POST", "/dflash/load", {"json": {"target": "/tmp/model"}}), 400,
                              "invalid_request"),
    "load a relative path": (("POST", "/dflash/load", {"json": {"target": THIS_FILE}}), 400,
                             "invalid_request"),
    "load a non-repo name": (("POST", "/dflash/load", {"json": {"target": "justaname"}}), 400,
                             "invalid_request"),
    "load a path as drafter": (("POST", "/dflash/load", {"json": {
        "target": "Qwen/Qwen3-8B", "drafter": "../drafter"}}), 400, "invalid_request"),
    "load a repo not in the cache": (("POST", "/dflash/load", {"json": {
        "target": "nobody/nothing-here"}}), 404, "model_not_found"),
    "load pair and target": (("POST", "/dflash/load", {"json": {
        "pair": "embedded", "target": "a/b"}}), 400, "invalid_request"),
    "load nothing": (("POST", "/dflash/load", {"json": {}}), 400, "invalid_request"),
    "load pair on a wrong engine": (("POST", "/dflash/load", {"json": {
        "pair": "qwen3-8b-mlx-4bit", "engine": "transformers"}}), 400, "invalid_request"),
    "load with recalibrate not a bool": (("POST", "/dflash/load", {"json": {
        "pair": "embedded", "recalibrate": "yes"}}), 400, "invalid_request"),
    "load unknown pair, recalibrated": (("POST", "/dflash/load", {"json": {
        "pair": "no-such-pair", "recalibrate": True}}), 404, "model_not_found"),
    "load with an unknown field": (("POST", "/dflash/load", {"json": {
        "pair": "embedded", "path": "/x"}}), 400, "invalid_request"),
    "download unknown pair": (("POST", "/dflash/downloads", {"json": {"pair": "nope"}}), 404,
                              "model_not_found"),
    "download an arbitrary repo": (("POST", "/dflash/downloads", {"json": {
        "repo": "someone/model"}}), 400, "invalid_request"),
    "download the shipped pair": (("POST", "/dflash/downloads", {"json": {"pair": "embedded"}}),
                                  400, "invalid_request"),
    "download with zero context": (("POST", "/dflash/downloads", {"json": {
        "pair": "qwen3-8b", "context_tokens": 0}}), 400, "invalid_request"),
    "events of an unknown download": (("GET", "/dflash/downloads/abc/events", {}), 404, "not_found"),
    "cancel an unknown download": (("DELETE", "/dflash/downloads/abc", {}), 404, "not_found"),
    # routing
    "unknown route": (("GET", "/v1/completions/nope", {}), 404, None),
    "wrong method": (("GET", CHAT, {}), 405, None),
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def server(pair, tmp_path_factory):
    _state, server = start_service(*pair, hub_cache_dir=tmp_path_factory.mktemp("hub"))
    yield server
    server.stop()


def test_enough_kinds_of_bad_input():
    assert len(BAD_REQUESTS) >= 30


@pytest.mark.parametrize("case", list(BAD_REQUESTS), ids=list(BAD_REQUESTS))
def test_bad_request(server, case):
    (method, path, kwargs), status, code = BAD_REQUESTS[case]
    response = httpx.request(method, server.url + path, timeout=60, **kwargs)
    assert_openai_error(response, status, code)


def test_server_still_serves_after_bad_input(server):
    response = httpx.post(server.url + CHAT, json={"messages": USER, "max_tokens": 3}, timeout=60)
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 3


def test_load_while_generating_is_refused(server):
    body = {"messages": USER, "max_tokens": 900, "stream": True, "speculative": False}
    with httpx.Client(timeout=60) as http, http.stream("POST", server.url + CHAT, json=body) as run:
        lines = run.iter_lines()
        assert next(lines).startswith("data: ")
        refused = http.post(server.url + "/dflash/load", json={"pair": "embedded"})
    assert_openai_error(refused, 409, "busy")


# --- the API key ---

@pytest.fixture(scope="module")
def locked_server(pair):
    _state, server = start_service(*pair, api_key="s3cret")
    yield server
    server.stop()


@pytest.mark.parametrize("headers", [
    {}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"},
    {"Authorization": "Bearer"}, {"Authorization": "s3cret"},
], ids=["missing", "wrong", "basic scheme", "empty bearer", "no scheme"])
@pytest.mark.parametrize("method,path", [
    ("GET", "/v1/models"), ("POST", CHAT), ("GET", "/dflash/status"), ("GET", "/dflash/catalog"),
    ("POST", "/dflash/load"), ("POST", "/dflash/downloads"),
])
def test_bad_api_key_is_refused(locked_server, headers, method, path):
    kwargs = {"content": b"{not json"} if method == "POST" else {}
    response = httpx.request(method, locked_server.url + path, headers=headers, timeout=60, **kwargs)
    assert_openai_error(response, 401, "invalid_api_key")
    assert response.headers["www-authenticate"] == "Bearer"


def test_health_needs_no_key_and_the_key_works(locked_server):
    assert httpx.get(locked_server.url + "/health").status_code == 200
    good = {"Authorization": "Bearer s3cret"}
    response = httpx.post(locked_server.url + CHAT, headers=good, timeout=60,
                          json={"messages": USER, "max_tokens": 2})
    assert response.status_code == 200


@pytest.mark.parametrize("fields", [{"speculative": False}, {"block_size": 4}, {"temperature": 0.7},
                                    {"prompt_lookup": False}])
def test_what_an_engine_cannot_do_is_refused(fields):
    from dflash_local.errors import InvalidRequestError
    from dflash_local.events import EngineCapabilities
    from dflash_local.service.chat import check_capabilities
    from dflash_local.service.schemas import ChatCompletionRequest

    fixed = EngineCapabilities(speculative_toggle=False, sampling=False, max_context=4096,
                               block_size_per_request=False)
    request = ChatCompletionRequest.model_validate({"messages": USER, **fields})
    with pytest.raises(InvalidRequestError, match="this engine"):
        check_capabilities(request, fixed)
    check_capabilities(ChatCompletionRequest.model_validate({"messages": USER}), fixed)
