"""Refusals outside the bad-input suite (test_service_bad_input.py): a load while generating, each
route behind the API key, what an engine declares it cannot do."""

from __future__ import annotations

import httpx
import pytest
from service_support import assert_openai_error, make_pair, start_service

USER = [{"role": "user", "content": "Hi"}]
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def server(pair, tmp_path_factory):
    _state, server = start_service(*pair, hub_cache_dir=tmp_path_factory.mktemp("hub"))
    yield server
    server.stop()


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
    from dflash_local.service.jobs import check_capabilities
    from dflash_local.service.openai_chat_schemas import ChatCompletionRequest

    fixed = EngineCapabilities(speculative_toggle=False, sampling=False, max_context=4096,
                               block_size_per_request=False)
    request = ChatCompletionRequest.model_validate({"messages": USER, **fields})
    with pytest.raises(InvalidRequestError, match="this engine"):
        check_capabilities(request, request.temperature, fixed)
    check_capabilities(ChatCompletionRequest.model_validate({"messages": USER}), None, fixed)
