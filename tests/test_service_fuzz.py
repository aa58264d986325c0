"""Property-based fuzzing of the service (Hypothesis). The three generation APIs get bodies shaped
like their requests, every field either a plausible value or any JSON value (deep, empty, the
wrong type, NaN, lone surrogates); every operation the app mounts, read from its own OpenAPI,
gets bodies drawn from its schema, any text in its path and query parameters, and raw bytes.
Whatever comes, the answer is never a 5xx and never a hang, and an error is in the API's own shape.

The server has no pair loaded, so a body that passes validation gets 503 "no pair loaded": the
validators are what is fuzzed. Lean by design: a bounded, derandomized number of examples per
operation (seconds), the same in every run.
"""

from __future__ import annotations

import json

import httpx
import pytest

hypothesis = pytest.importorskip("hypothesis")  # the dev extra's
from hypothesis import HealthCheck, given, settings
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


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from dflash_local.service.app import create_app
    from dflash_local.service.server import BackgroundServer
    from dflash_local.service.state import ServiceState

    state = ServiceState(hub_cache_dir=tmp_path_factory.mktemp("hub"))
    with BackgroundServer(create_app(state)) as server, \
            httpx.Client(base_url=server.url, timeout=NO_ANSWER_S) as http:
        yield http


def encoded(value) -> bytes:
    """JSON as a careless client writes it: NaN and Infinity as Python spells them, lone
    surrogates escaped."""
    return json.dumps(value, allow_nan=True).encode()


def assert_answered_in_shape(response: httpx.Response, api: str) -> None:
    """Below 500, or the 503 of a valid body with no pair loaded; an error in `api`'s shape."""
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
    no_pair = response.status_code == 503 and error["message"].startswith("no model is loaded")
    assert response.status_code < 500 or no_pair, (response.status_code, response.text)


def post(client: httpx.Client, path: str, content: bytes) -> httpx.Response:
    return client.post(path, content=content, headers={"content-type": "application/json"})


@pytest.mark.parametrize("api", list(APIS))
def test_no_request_body_gets_a_5xx_or_another_apis_shape(client, api):
    path, bodies = APIS[api]
    statuses = set()

    @FUZZ
    @given(bodies)
    def check(value):
        response = post(client, path, encoded(value))
        statuses.add(response.status_code)
        assert_answered_in_shape(response, api)

    check()
    assert {400, 503} <= statuses, f"the premise: both sides of the validators ({statuses})"


# Every operation the app mounts, read from its own OpenAPI at runtime, so a new route is fuzzed
# without editing this file: bodies drawn from each route's schema (each field sometimes any JSON),
# path and query parameters as any text, plus raw bytes where a route takes a body.
ROUTE_EXAMPLES = 20  # per operation and test: about half a second of requests each
ROUTE_FUZZ = settings(FUZZ, max_examples=ROUTE_EXAMPLES)
FREE_TEXT = st.text(max_size=20)
SCHEMA_DEPTH = 4  # deeper than this, a value is any JSON: keeps drawing bounded


def from_schema(schema: dict, components: dict, depth: int = 0):
    """A value shaped by a JSON Schema (the subset FastAPI writes), or now and then any JSON."""
    if "$ref" in schema:
        schema = components[schema["$ref"].rsplit("/", 1)[-1]]
    if depth > SCHEMA_DEPTH:
        return any_json
    if "const" in schema or "enum" in schema:
        shaped = st.sampled_from(schema.get("enum") or [schema["const"]])
    elif alternatives := schema.get("anyOf") or schema.get("oneOf"):
        shaped = st.one_of([from_schema(alt, components, depth + 1) for alt in alternatives])
    else:
        shaped = _typed(schema, components, depth)
    return field(shaped)


def _typed(schema: dict, components: dict, depth: int):
    kind = schema.get("type")
    if kind == "object" and "properties" in schema:
        required = set(schema.get("required", ()))
        drawn = {name: from_schema(sub, components, depth + 1)
                 for name, sub in schema["properties"].items()}
        return st.fixed_dictionaries({k: v for k, v in drawn.items() if k in required},
                                     optional={k: v for k, v in drawn.items() if k not in required})
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), components, depth + 1), max_size=3)
    plain = {"string": FREE_TEXT, "integer": st.integers(-2**64, 2**64), "boolean": st.booleans(),
             "number": st.floats(allow_nan=True, allow_infinity=True), "null": st.none()}
    return plain.get(kind, any_json)


def mounted_operations() -> list[tuple[str, str, dict]]:
    from dflash_local.service.app import create_app
    from dflash_local.service.state import ServiceState

    spec = create_app(ServiceState()).openapi()
    return [(method.upper(), path, {**operation, "components": spec["components"]["schemas"]})
            for path, operations in spec["paths"].items()
            for method, operation in operations.items()]


OPERATIONS = mounted_operations()


def request_parts(operation: dict):
    """Strategy for (path values, query, JSON body or None) of one operation."""
    components = operation["components"]
    params = operation.get("parameters", [])
    path_values = st.fixed_dictionaries(
        {p["name"]: FREE_TEXT for p in params if p["in"] == "path"})
    query = st.fixed_dictionaries({}, optional={
        p["name"]: from_schema(p["schema"], components).map(str)
        for p in params if p["in"] == "query"})
    request_body = operation.get("requestBody")
    if request_body is None:
        return st.tuples(path_values, query, st.none())
    schema = request_body["content"]["application/json"]["schema"]
    return st.tuples(path_values, query, from_schema(schema, components))


def send(client: httpx.Client, method: str, template: str, path_values: dict, query: dict,
         content: bytes | None) -> httpx.Response:
    """One request; a stream's body is read only when it is an error (a live stream never ends)."""
    from urllib.parse import quote

    path = template.format(**{name: quote(value, safe="") for name, value in path_values.items()})
    headers = {"content-type": "application/json"} if content is not None else {}
    request = client.build_request(method, path, params=query, content=content, headers=headers)
    response = client.send(request, stream=True)
    try:
        if response.status_code >= 400 or "event-stream" not in response.headers.get("content-type", ""):
            response.read()
    finally:
        response.close()
    return response


def error_shape(path: str) -> str:
    return "messages" if path.startswith("/v1/messages") else "openai"


def operation_id(operation: tuple[str, str, dict]) -> str:
    return f"{operation[0]} {operation[1]}"


def test_every_mounted_route_is_fuzzed():
    paths = {path for _method, path, _op in OPERATIONS}
    assert {"/v1/completions", "/v1/messages/count_tokens", "/dflash/load", "/dflash/downloads",
            "/dflash/catalog", "/dflash/status", "/v1/models"} <= paths, paths


@pytest.mark.parametrize("operation", OPERATIONS, ids=operation_id)
def test_no_request_to_any_route_gets_a_5xx(client, operation):
    method, template, spec = operation

    @ROUTE_FUZZ
    @given(request_parts(spec))
    def check(parts):
        path_values, query, value = parts
        content = None if value is None else encoded(value)
        response = send(client, method, template, path_values, query, content)
        assert_answered_in_shape(response, error_shape(template))

    check()


@pytest.mark.parametrize("operation", [op for op in OPERATIONS if "requestBody" in op[2]],
                         ids=operation_id)
def test_no_raw_bytes_to_any_route_get_a_5xx(client, operation):
    method, template, _spec = operation

    @FUZZ
    @given(st.binary(max_size=200) | st.text(max_size=50).map(str.encode))
    def check(raw):
        assert_answered_in_shape(send(client, method, template, {}, {}, raw), error_shape(template))

    check()
