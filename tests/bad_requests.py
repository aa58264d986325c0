"""The bad-input suite's cases: each a request, the status and code it must get, and the words
its error message must contain (the field and the value it names). Used by
test_service_bad_input.py against a real server with an API key; `request` adds the key."""

from __future__ import annotations

import json
import os
from pathlib import Path

KEY = "K3y"
USER = [{"role": "user", "content": "Hi"}]
CHAT = "/v1/chat/completions"
THIS_FILE = os.path.relpath(Path(__file__))  # an existing relative path with a '/'
BIG_BODY = 4 * 1024 * 1024 + 1  # one byte over the default limit


def chat(**fields) -> tuple:
    return ("POST", CHAT, {"json": {"messages": USER, "max_tokens": 4, **fields}})


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def raw(body: bytes | str, content_type: str | None = "application/json", path: str = CHAT) -> tuple:
    headers = {"content-type": content_type} if content_type else {}
    return ("POST", path, {"content": body.encode() if isinstance(body, str) else body,
                           "headers": headers})


def chat_json(extra: str) -> tuple:
    """A chat body with a literal JSON tail (NaN and Infinity are not JSON, but Python reads them)."""
    return raw('{"messages": ' + json.dumps(USER) + ', "max_tokens": 4, ' + extra + '}')


def user(content, **message) -> tuple:
    return chat(messages=[{"role": "user", "content": content, **message}])


def load(**fields) -> tuple:
    return ("POST", "/dflash/load", {"json": fields})


def download(**fields) -> tuple:
    return ("POST", "/dflash/downloads", {"json": fields})


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}

BAD = 400, "invalid_request"
UNKNOWN_MODEL = 404, "model_not_found"
TOO_LONG = 400, "context_length_exceeded"

# name: (request, (status, code), words the message must contain, case-insensitive)
CASES = {
    # framing
    "malformed json": (raw('{"messages": ['), BAD, ["not valid JSON", "character 14"]),
    "body is a list": (("POST", CHAT, {"json": [USER]}), BAD, ["JSON object", "[["]),
    "body is a string": (("POST", CHAT, {"json": "Hi"}), BAD, ["JSON object", "'Hi'"]),
    "body is a number": (("POST", CHAT, {"json": 7}), BAD, ["JSON object", "7"]),
    "empty body": (raw(b""), BAD, ["body is empty"]),
    "text/plain body": (raw(b"hello", "text/plain"), BAD, ["Content-Type", "text/plain"]),
    "no content type": (raw(b"hello", None), BAD, ["Content-Type", "none"]),
    "form body": (raw(b"a=1", "application/x-www-form-urlencoded"), BAD,
                  ["Content-Type", "x-www-form-urlencoded"]),
    "deeply nested json": (raw("[" * 100_000), BAD, ["body"]),
    "body over the limit": (raw(b" " * BIG_BODY), (413, "request_too_large"),
                            [str(BIG_BODY), "4194304"]),
    # messages
    "missing messages": (("POST", CHAT, {"json": {"max_tokens": 4}}), BAD,
                         ["messages", "Field required"]),
    "empty messages": (chat(messages=[]), BAD, ["messages", "[]"]),
    "messages is a string": (chat(messages="Hi"), BAD, ["messages", "'Hi'"]),
    "message is a string": (chat(messages=["Hi"]), BAD, ["messages.0", "'Hi'"]),
    "missing role": (chat(messages=[{"content": "Hi"}]), BAD, ["messages.0.role", "required"]),
    "unknown role": (chat(messages=[{"role": "wizard", "content": "Hi"}]), BAD,
                     ["messages.0.role", "wizard"]),
    "tool message without its call id": (chat(messages=[*USER, {"role": "tool", "content": "sunny"}]),
                                         BAD, ["messages.1.tool_call_id", "needs the id"]),
    "function role": (chat(messages=[{"role": "function", "content": "Hi"}]), BAD,
                      ["messages.0.role", "function"]),
    "numeric role": (chat(messages=[{"role": 1, "content": "Hi"}]), BAD, ["messages.0.role", "1"]),
    "missing content": (chat(messages=[{"role": "user"}]), BAD, ["messages.0.content", "required"]),
    "numeric content": (user(42), BAD, ["messages.0.content", "42"]),
    "null content": (user(None), BAD, ["messages.0.content", "null"]),
    "object content": (user({"text": "Hi"}), BAD, ["messages.0.content", "text"]),
    "image content part": (user([{"type": "image_url", "image_url": {"url": "http://x"}}]), BAD,
                           ["messages.0.content.0.type", "image_url"]),
    "text part without text": (user([{"type": "text"}]), BAD, ["messages.0.content.0.text", "required"]),
    "text part with a number": (user([{"type": "text", "text": 5}]), BAD,
                                ["messages.0.content.0.text", "5"]),
    "content part is a string": (user(["Hi"]), BAD, ["messages.0.content.0", "'Hi'"]),
    "lone surrogate in user content": (user("a\ud800b"), BAD, ["messages.0.content", "\\ud800"]),
    "lone surrogate, streaming": (chat(messages=[{"role": "user", "content": "a\ud800b"}], stream=True),
                                  BAD, ["messages.0.content", "\\ud800"]),
    "lone surrogate in a system message": (chat(messages=[{"role": "system", "content": "\udfff"},
                                                          *USER]), BAD,
                                           ["messages.0.content", "\\udfff"]),
    "lone surrogate in a text part": (user([{"type": "text", "text": "x\ud83d"}]), BAD,
                                      ["messages.0.content.0.text", "\\ud83d"]),
    "tool_calls with bad shape": (chat(messages=[*USER, {"role": "assistant", "content": "",
                                                         "tool_calls": [{"id": "c1"}]}]), BAD,
                                  ["messages.1.tool_calls.0.type", "required"]),
    "tool call arguments not JSON": (chat(messages=[*USER, {"role": "assistant", "content": None,
                                                            "tool_calls": [CALL | {"function": {
                                                                "name": "f", "arguments": "{city"}}]}]),
                                     BAD, ["messages.1.tool_calls.0.function.arguments", "JSON"]),
    "tool_calls on a user message": (user("Hi", tool_calls=[CALL]), BAD,
                                     ["messages.0.tool_calls", "'user'"]),
    "tool_call_id in a user message": (user("Hi", tool_call_id="c1"), BAD,
                                       ["messages.0.tool_call_id", "'user'"]),
    "prompt longer than the context": (user("x" * 3000), TOO_LONG,
                                       ["maximum context length is 1024 tokens", "resulted in"]),
    "a 3 MB prompt": (user("x" * 3_000_000), TOO_LONG, ["3000000 characters"]),
    # max_tokens
    "negative max_tokens": (chat(max_tokens=-5), BAD, ["max_tokens", "-5"]),
    "zero max_tokens": (chat(max_tokens=0), BAD, ["max_tokens", "(got 0)"]),
    "huge max_tokens": (chat(max_tokens=10**12), BAD, ["max_tokens", str(10**12)]),
    "string max_tokens": (chat(max_tokens="10"), BAD, ["max_tokens", "'10'"]),
    "float max_tokens": (chat(max_tokens=1.5), BAD, ["max_tokens", "1.5"]),
    "boolean max_tokens": (chat(max_tokens=True), BAD, ["max_tokens", "true"]),
    "max_tokens disagrees": (chat(max_completion_tokens=5), BAD,
                             ["max_tokens (4)", "max_completion_tokens (5)"]),
    "negative max_completion_tokens": (chat(max_completion_tokens=-1), BAD,
                                       ["max_completion_tokens", "-1"]),
    "string max_completion_tokens": (chat(max_completion_tokens="8"), BAD,
                                     ["max_completion_tokens", "'8'"]),
    # sampling
    "negative temperature": (chat(temperature=-0.1), BAD, ["temperature", "-0.1"]),
    "temperature above 2": (chat(temperature=2.5), BAD, ["temperature", "2.5"]),
    "string temperature": (chat(temperature="hot"), BAD, ["temperature", "'hot'"]),
    "boolean temperature": (chat(temperature=True), BAD, ["temperature", "true"]),
    "NaN temperature": (chat_json('"temperature": NaN'), BAD, ["temperature", "finite", "NaN"]),
    "infinite temperature": (chat_json('"temperature": Infinity'), BAD,
                             ["temperature", "finite", "Infinity"]),
    "top_p zero": (chat(top_p=0), BAD, ["top_p", "(got 0)"]),
    "top_p above 1": (chat(top_p=1.5), BAD, ["top_p", "1.5"]),
    "NaN top_p": (chat_json('"top_p": NaN'), BAD, ["top_p", "NaN"]),
    "string top_p": (chat(top_p="high"), BAD, ["top_p", "'high'"]),
    "negative seed": (chat(seed=-1), BAD, ["seed", "-1"]),
    "seed past 64 bits": (chat(seed=2**64), BAD, ["seed", str(2**64)]),
    "float seed": (chat(seed=1.5), BAD, ["seed", "1.5"]),
    "string seed": (chat(seed="42"), BAD, ["seed", "'42'"]),
    "n above 1": (chat(n=2), BAD, ["n:", "2"]),
    "n zero": (chat(n=0), BAD, ["n:", "(got 0)"]),
    "string n": (chat(n="1"), BAD, ["n:", "'1'"]),
    # stop
    "numeric stop": (chat(stop=7), BAD, ["stop", "7"]),
    "empty stop string": (chat(stop=[""]), BAD, ["stop", "0 characters"]),
    "nine stop strings": (chat(stop=[str(i) for i in range(9)]), BAD, ["stop", "got 9"]),
    "a 200000-character stop": (chat(stop="x" * 200_000), BAD, ["stop", "200000 characters"]),
    "eight long stops": (chat(stop=["x" * 200_000] * 8), BAD, ["stop", "200000 characters"]),
    "a number in the stop list": (chat(stop=["a", 3]), BAD, ["stop.1", "3"]),
    "null in the stop list": (chat(stop=[None]), BAD, ["stop.0", "null"]),
    "stop is an object": (chat(stop={"a": 1}), BAD, ["stop", '{"a": 1}']),
    "lone surrogate in stop": (chat(stop="\ud800"), BAD, ["stop", "\\ud800"]),
    # streaming
    "string stream": (chat(stream="yes"), BAD, ["stream", "'yes'"]),
    "null stream": (chat(stream=None), BAD, ["stream", "null"]),
    "stream_options without stream": (chat(stream_options={"include_usage": True}), BAD,
                                      ["stream_options", "stream is true"]),
    "string include_usage": (chat(stream=True, stream_options={"include_usage": "yes"}), BAD,
                             ["stream_options.include_usage", "'yes'"]),
    "stream_options not an object": (chat(stream=True, stream_options=True), BAD,
                                     ["stream_options", "true"]),
    # thinking and the DFlash extensions
    "string thinking": (chat(thinking="on"), BAD, ["thinking", "'on'"]),
    "string enable_thinking": (chat(chat_template_kwargs={"enable_thinking": "no"}), BAD,
                               ["enable_thinking", "'no'"]),
    "thinking disagrees": (chat(thinking=True, chat_template_kwargs={"enable_thinking": False}), BAD,
                           ["thinking (True)", "enable_thinking (False)"]),
    "chat_template_kwargs not an object": (chat(chat_template_kwargs="x"), BAD,
                                           ["chat_template_kwargs", "'x'"]),
    "block_size 0": (chat(block_size=0), BAD, ["block_size", "(got 0)"]),
    "block_size huge": (chat(block_size=100_000), BAD, ["block_size", "100000"]),
    "block_size word": (chat(block_size="fast"), BAD, ["block_size", "'fast'", "'auto'"]),
    "block_size numeric string": (chat(block_size="4"), BAD, ["block_size", "'4'"]),
    "block_size float": (chat(block_size=4.5), BAD, ["block_size", "4.5"]),
    "prompt_lookup word": (chat(prompt_lookup="yes"), BAD, ["prompt_lookup", "'yes'"]),
    "string speculative": (chat(speculative="yes"), BAD, ["speculative", "'yes'"]),
    "string tree": (chat(tree="no"), BAD, ["tree", "'no'"]),
    # logprobs
    "string logprobs": (chat(logprobs="yes"), BAD, ["logprobs", "'yes'"]),
    "top_logprobs without logprobs": (chat(top_logprobs=2), BAD,
                                      ["top_logprobs (2)", "logprobs: true", "None"]),
    "top_logprobs with logprobs false": (chat(logprobs=False, top_logprobs=0), BAD,
                                         ["top_logprobs (0)", "logprobs: true", "False"]),
    "top_logprobs over 20": (chat(logprobs=True, top_logprobs=21), BAD,
                             ["top_logprobs", "20", "21"]),
    "negative top_logprobs": (chat(logprobs=True, top_logprobs=-1), BAD, ["top_logprobs", "-1"]),
    "float top_logprobs": (chat(logprobs=True, top_logprobs=2.0), BAD, ["top_logprobs", "2.0"]),
    # OpenAI fields this server does not implement
    # tools
    "tools on a template without tools": (chat(tools=[TOOL]), BAD,
                                          ["tools", "chat template has no tool support"]),
    "tool parameters not an object schema": (chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "array"}}}]), BAD,
        ["tools.0.function.parameters", "object", '"array"']),
    "tool_choice naming an unknown function": (chat(tools=[TOOL], tool_choice={
        "type": "function", "function": {"name": "launch"}}), BAD, ["tool_choice", "'launch'", "f"]),
    "tool_choice required without tools": (chat(tool_choice="required"), BAD,
                                           ["tool_choice", "required", "tools"]),
    "tool_choice word": (chat(tools=[TOOL], tool_choice="always"), BAD, ["tool_choice", "'always'"]),
    "tool name with spaces": (chat(tools=[{"type": "function", "function": {"name": "get weather"}}]),
                              BAD, ["tools.0.function.name", "get weather"]),
    "functions": (chat(functions=[{"name": "f"}]), BAD, ["functions", '"f"']),
    "function_call": (chat(function_call="auto"), BAD, ["function_call", "'auto'"]),
    # structured output (issue 47): each refused before it is queued, naming the place and why
    "json_schema response_format without its json_schema": (
        chat(response_format={"type": "json_schema"}), BAD, ["response_format.json_schema", "required"]),
    "response_format of an unknown type": (chat(response_format={"type": "yaml"}), BAD,
                                           ["response_format", "yaml"]),
    "invalid JSON Schema": (chat(response_format=schema_format({"type": "objectz"})), BAD,
                            ["response_format.json_schema.schema", "objectz"]),
    "unsupported JSON Schema keyword": (
        chat(response_format=schema_format({"type": "object", "if": {}, "then": {}})), BAD,
        ["response_format.json_schema.schema", "unsupported", '"if"']),
    "JSON Schema with a dangling $ref": (
        chat(response_format=schema_format({"$ref": "#/$defs/missing"})), BAD,
        ["response_format.json_schema.schema", "/$defs/missing"]),
    "regex that cannot match": (chat(structured_outputs={"regex": "[^\\s\\S]"}), BAD,
                                ["structured_outputs.regex", "cannot match"]),
    "regex that does not parse": (chat(structured_outputs={"regex": "a{2,1}"}), BAD,
                                  ["structured_outputs.regex", "a{2,1}"]),
    "Lark grammar that does not parse": (chat(structured_outputs={"grammar": "start: missing_rule"}),
                                         BAD, ["structured_outputs.grammar", "missing_rule"]),
    "structured_outputs with both": (chat(structured_outputs={"regex": "a", "grammar": 'start: "a"'}),
                                     BAD, ["structured_outputs", "exactly one"]),
    "schema over the size cap": (chat(structured_outputs={"regex": "a" * 200_001}), BAD,
                                 ["structured_outputs.regex", "200001", "limit"]),
    "two constraints at once": (chat(response_format={"type": "json_object"},
                                     structured_outputs={"regex": "a+"}), BAD,
                                ["response_format", "structured_outputs", "give one"]),
    "thinking with a constrained reply": (chat(response_format={"type": "json_object"}, thinking=True),
                                          BAD, ["thinking", "turn thinking off"]),
    "strict tool whose schema does not compile": (chat(tools=[{"type": "function", "function": {
        "name": "f", "strict": True, "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "dependentSchemas": {}}}}}}]), BAD,
        ["tools.0.function", "parameters (strict)", "dependentSchemas"]),
    "logit_bias": (chat(logit_bias={"50256": -100}), BAD, ["logit_bias", "50256"]),
    "presence_penalty": (chat(presence_penalty=1), BAD, ["presence_penalty", "1"]),
    "frequency_penalty": (chat(frequency_penalty=0.5), BAD, ["frequency_penalty", "0.5"]),
    "audio modality": (chat(modalities=["text", "audio"]), BAD, ["modalities", "audio"]),
    "audio": (chat(audio={"voice": "alloy"}), BAD, ["audio", "alloy"]),
    "prediction": (chat(prediction={"type": "content", "content": "x"}), BAD, ["prediction", "content"]),
    "web_search_options": (chat(web_search_options={}), BAD, ["web_search_options", "{}"]),
    "reasoning_effort": (chat(reasoning_effort="high"), BAD, ["reasoning_effort", "'high'"]),
    # model names
    "another known pair's model": (chat(model="qwen3-8b-mlx-4bit"), UNKNOWN_MODEL,
                                   ["qwen3-8b-mlx-4bit"]),
    "another known pair's target": (chat(model="Qwen/Qwen3.5-4B"), UNKNOWN_MODEL, ["Qwen/Qwen3.5-4B"]),
    "absolute path model": (chat(model="/etc/passwd"), BAD, ["/etc/passwd", "paths are not accepted"]),
    "parent path model": (chat(model="models/../../etc"), BAD, ["models/../../etc"]),
    "home path model": (chat(model="~/models/x"), BAD, ["~/models/x"]),
    "windows path model": (chat(model="C:\\models\\x"), BAD, ["C:"]),
    "numeric model": (chat(model=123), BAD, ["model", "123"]),
    "model name of 300 characters": (chat(model="a" * 300), BAD, ["a" * 100]),
    "NUL in the model name": (chat(model="a\x00b"), BAD, ["a\\x00b"]),
    "lone surrogate in the model name": (chat(model="m\ud800"), BAD, ["model", "\\ud800"]),
    # loading
    "load an unknown pair": (load(pair="no-such-pair"), UNKNOWN_MODEL, ["no-such-pair"]),
    "load a path as target": (load(target="/tmp/model"), BAD, ["/tmp/model"]),
    "load an existing relative path": (load(target=THIS_FILE), UNKNOWN_MODEL, [THIS_FILE]),
    "load a non-repo name": (load(target="justaname"), BAD, ["justaname"]),
    "load a path as drafter": (load(target="Qwen/Qwen3-8B", drafter="../drafter"), BAD, ["../drafter"]),
    "load a repo not in the cache": (load(target="nobody/nothing-here"), UNKNOWN_MODEL,
                                     ["nobody/nothing-here"]),
    "load pair and target": (load(pair="embedded", target="a/b"), BAD, ["pair", "target"]),
    "load nothing": (load(), BAD, ["pair", "target"]),
    "load a pair on a wrong engine": (load(pair="qwen3-8b-mlx-4bit", engine="transformers"), BAD,
                                      ["qwen3-8b-mlx-4bit", "transformers"]),
    "load an unknown engine": (load(target="owner/name", engine="foo"), BAD, ["engine", "'foo'"]),
    "load a pair on an unknown engine": (load(pair="embedded", engine="foo"), BAD, ["engine", "'foo'"]),
    "load the relay by name": (load(target="127.0.0.1/v1", engine="openai"), BAD,
                               ["engine: 'openai'", "--base-url"]),
    "load with recalibrate not a bool": (load(pair="embedded", recalibrate="yes"), BAD,
                                         ["recalibrate", "'yes'"]),
    "load with an unknown field": (load(pair="embedded", path="/x"), BAD, ["path", "'/x'"]),
    "load with a bad block_size": (load(pair="embedded", block_size="fast"), BAD,
                                   ["block_size", "'fast'"]),
    "load a numeric pair": (load(pair=5), BAD, ["pair", "5"]),
    "load a pair with a drafter": (load(pair="embedded", drafter="a/b"), BAD, ["drafter", "pair"]),
    "load a 300-character pair id": (load(pair="p" * 300), BAD, ["pair", "p" * 50]),
    # downloads
    "download an unknown pair": (download(pair="nope"), UNKNOWN_MODEL, ["nope"]),
    "download an arbitrary repo": (download(repo="someone/model"), BAD, ["repo", "someone/model"]),
    "download the shipped pair": (download(pair="embedded"), BAD, ["embedded"]),
    "download with zero context": (download(pair="qwen3-8b", context_tokens=0), BAD,
                                   ["context_tokens", "(got 0)"]),
    "download with a string context": (download(pair="qwen3-8b", context_tokens="4096"), BAD,
                                       ["context_tokens", "'4096'"]),
    "events of an unknown download": (("GET", "/dflash/downloads/abc/events", {}), (404, "not_found"),
                                      ["abc"]),
    "an unknown download": (("GET", "/dflash/downloads/abc", {}), (404, "not_found"), ["abc"]),
    "cancel an unknown download": (("DELETE", "/dflash/downloads/abc", {}), (404, "not_found"), ["abc"]),
    # routes
    "unknown route": (("GET", "/v1/completions/nope", {}), (404, None), ["/v1/completions/nope"]),
    "GET on chat": (("GET", CHAT, {}), (405, None), ["GET", CHAT]),
    "DELETE on models": (("DELETE", "/v1/models", {}), (405, None), ["DELETE", "/v1/models"]),
    "PUT on load": (("PUT", "/dflash/load", {"json": {}}), (405, None), ["PUT", "/dflash/load"]),
    "the OpenAPI schema": (("GET", "/openapi.json", {}), (404, None), ["/openapi.json"]),
    "the docs page": (("GET", "/docs", {}), (404, None), ["/docs"]),
    # the API key (never echoed)
    "no API key": (("GET", "/v1/models", {"headers": {"Authorization": ""}}),
                   (401, "invalid_api_key"), ["API key", "Authorization"]),
    "a wrong API key": (("POST", CHAT, {"headers": {"Authorization": "Bearer nope"}, "json": {}}),
                        (401, "invalid_api_key"), ["API key", "Bearer"]),
    "the key as Basic": (("GET", "/dflash/status", {"headers": {"Authorization": f"Basic {KEY}"}}),
                         (401, "invalid_api_key"), ["API key", "Bearer"]),
    "the key with no scheme": (("POST", "/dflash/load", {"headers": {"Authorization": KEY}}),
                               (401, "invalid_api_key"), ["API key", "Bearer"]),
    # the Host header (DNS rebinding)
    "a foreign Host": (("GET", "/v1/models", {"headers": {"Host": "evil.example"}}),
                       (400, "host_not_allowed"), ["Host", "evil.example", "--allow-host"]),
    "a rebinding Host with a port": (("POST", CHAT, {"headers": {"Host": "127.0.0.1.nip.io:8000"},
                                                     "json": {"messages": USER}}),
                                     (400, "host_not_allowed"), ["Host", "127.0.0.1.nip.io:8000"]),
}


def request_kwargs(kwargs: dict) -> dict:
    """The case's httpx arguments, with the API key unless the case sets Authorization itself;
    JSON is encoded ASCII-only here, so a lone surrogate travels as JSON's own escape."""
    kwargs = dict(kwargs)
    headers = {"Authorization": f"Bearer {KEY}", **kwargs.pop("headers", {})}
    if "json" in kwargs:
        kwargs["content"] = json.dumps(kwargs.pop("json")).encode()
        headers["content-type"] = "application/json"
    return {**kwargs, "headers": {name: value for name, value in headers.items() if value}}
