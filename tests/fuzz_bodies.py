"""The Hypothesis strategies and checks the service's fuzz tests share: bodies shaped like each
generating API's requests (every field either a plausible value or any JSON value: deep, empty,
the wrong type, NaN, lone surrogates), and the check that an answer is below 500 and an error is
in its API's own shape."""

from __future__ import annotations

import json

import httpx
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

EXAMPLES = 50  # per API and test: about a second of requests each, on an idle machine
NO_ANSWER_S = 30.0  # an answer slower than this is a hang

FUZZ = settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow, HealthCheck.data_too_large])

scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20))
any_json = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=12)


def field(plausible):
    """Mostly a plausible value, sometimes anything at all."""
    return st.one_of(plausible, plausible, any_json)


def body(required: dict, optional: dict):
    return st.fixed_dictionaries({k: field(v) for k, v in required.items()},
                                 optional={k: field(v) for k, v in optional.items()})


NAMES = st.sampled_from(["f", "get_weather", "a.b-c", "", "f\n", "x" * 70, "f<|im_end|>"])
IDS = st.sampled_from(["call_1", "call_2", "toolu_1", ""])
TEXT = st.text(max_size=30)
SCHEMA = st.fixed_dictionaries({"type": st.sampled_from(["object", "string", "array"])},
                               optional={"properties": any_json, "required": any_json})
ARGUMENTS = st.sampled_from(['{"city": "Paris"}', "{}", "[]", "{", "1", '{"a":' * 150 + "1" + "}" * 150])
COMMON = {"model": st.sampled_from(["tiny", "", "gpt-4o"]), "stream": st.booleans(),
          "temperature": st.floats(-1, 3), "top_p": st.floats(-1, 2),
          "block_size": st.sampled_from([1, 8, "auto", 0, 300]), "speculative": st.booleans()}

CHAT_CALL = body({"id": IDS, "type": st.just("function"),
                  "function": body({"name": NAMES, "arguments": ARGUMENTS}, {})}, {})
CHAT_MESSAGE = body({"role": st.sampled_from(["system", "developer", "user", "assistant", "tool",
                                              "function"])},
                    {"content": st.one_of(TEXT, st.none(), st.lists(
                        body({"type": st.just("text"), "text": TEXT}, {}), max_size=3)),
                     "tool_calls": st.lists(CHAT_CALL, max_size=2), "tool_call_id": IDS,
                     "name": NAMES})
CHAT = body({"messages": st.lists(CHAT_MESSAGE, max_size=4)}, {
    **COMMON, "max_tokens": st.integers(-1, 10**7), "max_completion_tokens": st.integers(0, 9),
    "n": st.integers(0, 3), "seed": st.integers(-1, 2**64), "stop": st.lists(TEXT, max_size=9),
    "logprobs": st.booleans(), "top_logprobs": st.integers(-1, 30),
    "tools": st.lists(body({"type": st.just("function"), "function": body(
        {"name": NAMES}, {"parameters": SCHEMA, "description": TEXT})}, {}), max_size=3),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]), body(
        {"type": st.just("function"), "function": body({"name": NAMES}, {})}, {})),
    "stream_options": body({}, {"include_usage": st.booleans()}),
    "chat_template_kwargs": body({}, {"enable_thinking": st.booleans()}),
    "response_format": body({"type": st.sampled_from(["text", "json_object", "json_schema"])}, {}),
})

BLOCK = st.one_of(
    body({"type": st.just("text"), "text": TEXT}, {}),
    body({"type": st.just("tool_use"), "id": IDS, "name": NAMES, "input": any_json}, {}),
    body({"type": st.just("tool_result"), "tool_use_id": IDS}, {"content": TEXT,
                                                                "is_error": st.booleans()}),
    body({"type": st.sampled_from(["thinking", "image", "document"])}, {"thinking": TEXT}))
MESSAGES = body({"model": COMMON["model"], "max_tokens": st.integers(-1, 10**7),
                 "messages": st.lists(body({"role": st.sampled_from(["user", "assistant", "system"])},
                                           {"content": st.one_of(TEXT, st.lists(BLOCK, max_size=3))}),
                                      max_size=4)}, {
    **{name: value for name, value in COMMON.items() if name != "model"}, "system": st.one_of(TEXT, st.lists(BLOCK, max_size=2)), "top_k": st.integers(-1, 9),
    "stop_sequences": st.lists(TEXT, max_size=9),
    "tools": st.lists(body({"name": NAMES}, {"input_schema": SCHEMA, "type": st.sampled_from(
        ["custom", "web_search_20250305", "bash_20250124"])}), max_size=3),
    "tool_choice": body({"type": st.sampled_from(["auto", "any", "tool", "none"])}, {"name": NAMES}),
    "thinking": body({"type": st.sampled_from(["enabled", "disabled"])},
                     {"budget_tokens": st.integers(-1, 10**6)}),
})

ITEM = st.one_of(
    body({"role": st.sampled_from(["user", "assistant", "system", "developer"])},
         {"type": st.just("message"), "content": st.one_of(TEXT, st.lists(
             body({"type": st.sampled_from(["input_text", "output_text"]), "text": TEXT}, {}),
             max_size=2))}),
    body({"type": st.just("function_call"), "call_id": IDS, "name": NAMES, "arguments": ARGUMENTS}, {}),
    body({"type": st.sampled_from(["function_call_output", "custom_tool_call_output"]),
          "call_id": IDS, "output": TEXT}, {}),
    body({"type": st.just("custom_tool_call"), "call_id": IDS, "name": NAMES, "input": TEXT}, {}),
    body({"type": st.just("reasoning")}, {"summary": any_json}))
RESPONSES = body({"input": st.one_of(TEXT, st.lists(ITEM, max_size=4))}, {
    **COMMON, "max_output_tokens": st.integers(-1, 10**7), "instructions": TEXT,
    "tools": st.lists(st.one_of(
        body({"type": st.just("function"), "name": NAMES}, {"parameters": SCHEMA}),
        body({"type": st.sampled_from(["custom", "namespace", "web_search", "file_search"]),
              "name": NAMES}, {"tools": any_json, "format": any_json})), max_size=3),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]),
                             body({"type": st.just("function"), "name": NAMES}, {})),
    "reasoning": body({}, {"effort": st.sampled_from(["low", "high", "none"]), "summary": TEXT}),
    "store": st.booleans(), "previous_response_id": TEXT, "text": any_json, "include": any_json,
})

# valid bodies, so every run also crosses each validator to its far side (503: no pair)
SETTINGS = {"max_tokens": st.integers(1, 64), "temperature": st.floats(0, 1), "stream": st.booleans(),
            "block_size": st.sampled_from([1, 8, "auto"])}
USER_TURNS = st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": TEXT}),
                      min_size=1, max_size=3)
CHAT_VALID = st.fixed_dictionaries({"messages": USER_TURNS}, optional=SETTINGS)
MESSAGES_VALID = st.fixed_dictionaries({"model": st.just("tiny"), "max_tokens": st.integers(1, 64),
                                        "messages": USER_TURNS},
                                       optional={"temperature": st.floats(0, 1)})
RESPONSES_VALID = st.fixed_dictionaries({"input": st.one_of(TEXT, USER_TURNS)},
                                        optional={"max_output_tokens": st.integers(1, 64)})

APIS = {"chat": ("/v1/chat/completions", CHAT_VALID | CHAT),
        "messages": ("/v1/messages", MESSAGES_VALID | MESSAGES),
        "responses": ("/v1/responses", RESPONSES_VALID | RESPONSES)}

TOKEN_IDS = st.lists(st.integers(-1, 70_000) | st.sampled_from([0, 1, 2, 3, 2**31, 2**64]),
                     max_size=6)
PROMPT = st.one_of(TEXT, TOKEN_IDS, st.lists(TEXT, max_size=3), st.lists(TOKEN_IDS, max_size=3))
COMPLETIONS = body({"prompt": PROMPT}, {
    **COMMON, "max_tokens": st.integers(-1, 10**7), "echo": st.booleans(),
    "logprobs": st.integers(-1, 30), "stop": st.lists(TEXT, max_size=9), "n": st.integers(0, 3),
    "suffix": TEXT, "best_of": st.integers(0, 3), "seed": st.integers(-1, 2**64),
    "stream_options": body({}, {"include_usage": st.booleans()}),
    "structured_outputs": body({}, {"regex": st.sampled_from(["[a-z]+", "(", "a{99999}", ""]),
                                    "grammar": st.sampled_from(['start: "a"+', "start:", ""])}),
})
COMPLETIONS_VALID = st.fixed_dictionaries({"prompt": st.one_of(TEXT.filter(bool), st.lists(
    st.integers(4, 200), min_size=1, max_size=6))}, optional=SETTINGS)


def encoded(value) -> bytes:
    """JSON as a careless client writes it: NaN and Infinity as Python spells them, lone
    surrogates escaped."""
    return json.dumps(value, allow_nan=True).encode()


def assert_answered_in_shape(response: httpx.Response, api: str, no_pair_ok: bool = True) -> None:
    """Below 500, or (`no_pair_ok`) the 503 of a valid body with no pair loaded; an error in
    `api`'s shape."""
    if response.status_code < 400:
        return
    payload = response.json()
    if api == "messages":
        assert payload["type"] == "error", payload
    error = payload["error"]
    assert isinstance(error["message"], str) and error["message"], payload
    assert isinstance(error["type"], str), payload
    if api != "messages":
        assert "code" in error, payload
    no_pair = no_pair_ok and response.status_code == 503 \
        and error["message"].startswith("no model is loaded")
    assert response.status_code < 500 or no_pair, (response.status_code, response.text)


def post(client: httpx.Client, path: str, content: bytes) -> httpx.Response:
    return client.post(path, content=content, headers={"content-type": "application/json"})
