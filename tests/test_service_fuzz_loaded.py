"""Property-based fuzzing of the generating operations with a pair loaded (Hypothesis): chat,
Responses, Messages, legacy completions and count_tokens against the real server on a tiny random
pair, so a body that passes validation is templated, tokenized, constrained and generated. Every
answer is below 500 and arrives, an error is in its API's own shape, and a stream carries no
server error. test_service_fuzz.py fuzzes the validators alone (no pair loaded).

Each body's reply is clamped to MAX_NEW_TOKENS (a drawn count above it, or none, becomes it), so
an example costs a prefill and a few rounds: bounded, derandomized examples, the same every run.
"""

from __future__ import annotations

import httpx
import pytest

hypothesis = pytest.importorskip("hypothesis")  # the dev extra's
from fuzz_bodies import (
    APIS,
    COMPLETIONS,
    COMPLETIONS_VALID,
    FUZZ,
    NO_ANSWER_S,
    assert_answered_in_shape,
    encoded,
)
from hypothesis import given, settings
from service_support import serve_module

MAX_NEW_TOKENS = 3
LOADED_FUZZ = settings(FUZZ, max_examples=40)  # per operation: a few seconds each on two cores
# path, bodies, the fields that cap the reply's tokens, the error shape
OPERATIONS = {
    "chat": (*APIS["chat"], ("max_completion_tokens", "max_tokens"), "openai"),
    "responses": (*APIS["responses"], ("max_output_tokens",), "openai"),
    "messages": (*APIS["messages"], ("max_tokens",), "messages"),
    "count_tokens": ("/v1/messages/count_tokens", APIS["messages"][1], (), "messages"),
    "completions": ("/v1/completions", COMPLETIONS_VALID | COMPLETIONS, ("max_tokens",), "openai"),
}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    for _state, server in serve_module(tmp_path_factory):
        with httpx.Client(base_url=server.url, timeout=NO_ANSWER_S) as http:
            yield http


def clamped(value, caps: tuple[str, ...]):
    """`value` with each drawn token cap above MAX_NEW_TOKENS lowered to it, and the first cap
    set when none is drawn (a wrong type stays: the validators must refuse it)."""
    if not isinstance(value, dict) or not caps:
        return value
    value = dict(value)
    if not any(cap in value for cap in caps):
        value[caps[-1]] = MAX_NEW_TOKENS
    for cap in caps:
        drawn = value.get(cap)
        if isinstance(drawn, int) and not isinstance(drawn, bool) and drawn > MAX_NEW_TOKENS:
            value[cap] = MAX_NEW_TOKENS
    return value


def answer(client: httpx.Client, path: str, content: bytes) -> tuple[httpx.Response, bytes]:
    """The response and its whole body (a stream read to its end)."""
    with client.stream("POST", path, content=content,
                       headers={"content-type": "application/json"}) as response:
        return response, response.read()


def assert_stream_has_no_server_error(response: httpx.Response, body: bytes) -> None:
    if "event-stream" in response.headers.get("content-type", ""):
        assert b"internal server error" not in body and b'"api_error"' not in body, body[-600:]


@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_no_body_to_a_loaded_pair_gets_a_5xx(client, operation):
    path, bodies, caps, shape = OPERATIONS[operation]
    statuses = set()

    @LOADED_FUZZ
    @given(bodies.map(lambda value: clamped(value, caps)))
    def check(value):
        response, body = answer(client, path, encoded(value))
        statuses.add(response.status_code)
        assert_answered_in_shape(response, shape, no_pair_ok=False)
        assert_stream_has_no_server_error(response, body)

    check()
    assert {200, 400} <= statuses, f"the premise: bodies on both sides of the validators ({statuses})"
