"""Heavy but legal bodies that cannot fit the context are refused before they reach the only
worker: many empty tool results, many messages, many function_call items, a huge tool schema.
Each is refused with context_length_exceeded, and the worker never sees the job: the early
check counts each message's markup at its role's measured floor, and the texts the template
renders, so the worker never templates thousands of messages only to refuse them."""

from __future__ import annotations

import httpx
import pytest
from service_support import assert_openai_error, serve_module

CONTEXT = 1024  # the tiny pair's
MANY = 3 * CONTEXT  # each message costs at least one token of markup
HUGE_DESCRIPTION = "a schema property described at length " * 10_000  # ~390 KB, under 4 MiB
USER = {"role": "user", "content": "Hi"}


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    yield from serve_module(tmp_path_factory)


@pytest.fixture
def submitted(service):
    """The jobs the worker is handed during the test."""
    worker = service[0].loaded.worker
    jobs, submit = [], worker.submit
    worker.submit = lambda job: (jobs.append(job), submit(job))[-1]
    yield jobs
    worker.submit = submit


def call(index: int) -> dict:
    return {"id": f"c{index}", "type": "function", "function": {"name": "f", "arguments": "{}"}}


BODIES = {
    "chat: many empty tool results": ("/v1/chat/completions", {"messages": [
        USER, {"role": "assistant", "content": None, "tool_calls": [call(0)]},
        *({"role": "tool", "tool_call_id": "c0", "content": ""} for _ in range(MANY))]}),
    "chat: many messages": ("/v1/chat/completions", {"messages": [
        {"role": "user" if index % 2 == 0 else "assistant", "content": "x"}
        for index in range(MANY)]}),
    # each message's markup is several tokens: as many messages as the context has tokens
    "chat: a message per context token": ("/v1/chat/completions", {"messages": [
        {"role": "user" if index % 2 == 0 else "assistant", "content": "x"}
        for index in range(CONTEXT)]}),
    "responses: a function_call item per context token": ("/v1/responses", {"input": [
        item for index in range(CONTEXT // 2) for item in (
            {"type": "function_call", "call_id": f"c{index}", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": f"c{index}", "output": ""})]}),
    "chat: a huge tool schema": ("/v1/chat/completions", {"messages": [USER], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
         "properties": {"x": {"type": "string", "description": HUGE_DESCRIPTION}}}}}]}),
    "responses: many function_call items": ("/v1/responses", {"input": [
        item for index in range(MANY // 2) for item in (
            {"type": "function_call", "call_id": f"c{index}", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": f"c{index}", "output": ""})]}),
    # strict: false, as chat's: a strict tool's schema meets the constraint's own size cap first
    "responses: a huge tool schema": ("/v1/responses", {"input": "Hi", "tools": [
        {"type": "function", "name": "f", "strict": False, "parameters": {"type": "object",
         "properties": {"x": {"type": "string", "description": HUGE_DESCRIPTION}}}}]}),
}


@pytest.mark.parametrize("case", list(BODIES))
def test_a_body_that_cannot_fit_is_refused_before_the_worker(service, submitted, case):
    path, body = BODIES[case]
    limit = {"max_output_tokens": 4} if path == "/v1/responses" else {"max_tokens": 4}
    response = httpx.post(service[1].url + path, json={"model": "tiny", **limit, **body},
                          timeout=120)
    message = assert_openai_error(response, 400, "context_length_exceeded")["message"]
    assert f"context of {CONTEXT} tokens" in message
    assert submitted == []


def test_many_empty_tool_results_on_messages_are_refused_before_the_worker(service, submitted):
    turns = [USER]
    for index in range(MANY // 2):
        turns += [{"role": "assistant", "content": [
                      {"type": "tool_use", "id": f"t{index}", "name": "f", "input": {}}]},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": f"t{index}", "content": ""}]}]
    response = httpx.post(service[1].url + "/v1/messages", timeout=120,
                          json={"model": "tiny", "max_tokens": 4, "messages": turns})
    assert response.status_code == 400, response.text
    assert f"context of {CONTEXT} tokens" in response.json()["error"]["message"]
    assert submitted == []


def test_a_body_that_fits_still_reaches_the_worker(service, submitted):
    response = httpx.post(service[1].url + "/v1/chat/completions", timeout=60,
                          json={"model": "tiny", "max_tokens": 4, "messages": [USER]})
    assert response.status_code == 200, response.text
    assert len(submitted) == 1
