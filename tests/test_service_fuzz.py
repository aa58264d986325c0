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

import httpx
import pytest

hypothesis = pytest.importorskip("hypothesis")  # the dev extra's
from fuzz_bodies import (
    APIS,
    FUZZ,
    NO_ANSWER_S,
    any_json,
    assert_answered_in_shape,
    encoded,
    field,
    post,
)
from hypothesis import given, settings
from hypothesis import strategies as st


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from dflash_local.service.app import create_app
    from dflash_local.service.server import BackgroundServer
    from dflash_local.service.state import ServiceState

    state = ServiceState(hub_cache_dir=tmp_path_factory.mktemp("hub"))
    with BackgroundServer(create_app(state)) as server, \
            httpx.Client(base_url=server.url, timeout=NO_ANSWER_S) as http:
        yield http


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
