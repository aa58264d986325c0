"""The bad-input suite: well over a hundred kinds of hostile or careless request against the real
server (with an API key), each answered with the right status and an error that names the field
and the value; none a 500, and the service answers as before once the suite has run."""

from __future__ import annotations

import re

import httpx
import pytest
from bad_requests import CASES, CHAT, KEY, USER, request_kwargs
from service_support import assert_openai_error, make_pair, start_service

AUTH = {"Authorization": f"Bearer {KEY}"}
SERVER_PATH = re.compile(r"(/tmp/|/root/|/home/|/work/|/Users/)")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def server(pair, tmp_path_factory):
    _state, server = start_service(*pair, api_key=KEY, hub_cache_dir=tmp_path_factory.mktemp("hub"))
    yield server
    server.stop()


def greedy_reply(server) -> dict:
    response = httpx.post(server.url + CHAT, headers=AUTH, timeout=60,
                          json={"messages": USER, "max_tokens": 6, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def reply_before(server) -> dict:
    return greedy_reply(server)


def test_the_suite_covers_enough_kinds():
    assert len(CASES) >= 100


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_bad_input(server, reply_before, case):
    (method, path, kwargs), (status, code), words = CASES[case]
    response = httpx.request(method, server.url + path, timeout=60, **request_kwargs(kwargs))
    error = assert_openai_error(response, status, code)
    for word in words:
        assert word.lower() in error["message"].lower(), (word, error["message"])
    assert KEY not in response.text
    if status != 400 or "paths are not accepted" not in error["message"]:
        assert not SERVER_PATH.search(error["message"]), error["message"]


def test_the_service_answers_as_before_after_the_suite(server, reply_before):
    after = greedy_reply(server)
    assert after["choices"][0]["message"] == reply_before["choices"][0]["message"]
    assert after["usage"]["completion_tokens"] == reply_before["usage"]["completion_tokens"]
    models = httpx.get(server.url + "/v1/models", headers=AUTH, timeout=60).json()
    assert [model["id"] for model in models["data"]] == ["tiny"]
