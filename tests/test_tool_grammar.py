"""tool_grammar.compose, read by the real grammar engine: for each call format, the grammar a
request gets admits the calls its strict tools allow and no other, token by token through the
compiled matcher on agent_tiny's tokenizer (its <tool_call> markers are added tokens, as Qwen's
are); the formats it cannot write leave the reply free with a note. No model runs here."""

from __future__ import annotations

import json

import pytest
from agent_tiny import make_tokenizer

from dflash_local.constraints.compile import ConstraintCompiler
from dflash_local.events import OutputConstraint
from dflash_local.service.tool_calls import ToolSupport
from dflash_local.service.tool_formats import format_for_template
from dflash_local.service.tool_grammar import compose

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Lyon", "Nice"]}}, "required": ["city"],
    "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}}
STRICT = {"get_weather": WEATHER["function"]["parameters"]}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# a template's text is enough for format_for_template to name its format
TEMPLATES = {"hermes": "<tool_call>\\n", "llama3_json": "<|python_tag|>",
             "qwen3_coder": "<tool_call><function=", "harmony": "to=functions"}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return ConstraintCompiler(tokenizer)


def support(format_name: str) -> ToolSupport:
    return ToolSupport("tiny", True, True, format_for_template(TEMPLATES[format_name]),
                       harmony=format_name == "harmony")


@pytest.fixture
def admits(compiler, tokenizer):
    return lambda constraint, text: _admits(compiler, tokenizer, constraint, text)


def _admits(compiler, tokenizer, constraint: OutputConstraint, text: str) -> bool:
    """Whether the grammar takes `text`, token by token, and may end after it."""
    grammar = compiler.grammar(constraint)
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        if not grammar.allowed()[token_id]:
            return False
        grammar.consume(token_id)
    return grammar.complete()


def call(name: str, arguments: dict, key: str = "arguments") -> str:
    return json.dumps({"name": name, key: arguments})


@pytest.mark.parametrize(("choice", "good", "bad"), [
    (NAMED, '{"city": "Nice"}}\n</tool_call>', '{"city": "Paris"}}\n</tool_call>'),
    ("required", "\n" + call("get_weather", {"city": "Lyon"}) + "</tool_call><tool_call>"
     + call("clock", {"any": [1]}) + "</tool_call>",
     call("get_weather", {"city": "Lyon", "days": 2}) + "</tool_call>"),
])
def test_a_forced_hermes_call_continues_the_prompts_opener(admits, choice, good, bad):
    grammar = compose(support("hermes"), (WEATHER, CLOCK), choice, STRICT, None)
    assert admits(grammar.constraint, good)
    assert not admits(grammar.constraint, bad)


@pytest.mark.parametrize(("choice", "good", "bad"), [
    (NAMED, '{"city": "Lyon"}}', '{"town": "Lyon"}}'),
    ("required", 'get_weather", "parameters": {"city": "Nice"}}', 'get_weather", "parameters": {}}'),
])
def test_a_forced_llama3_json_call_continues_the_prompts_opener(admits, choice, good, bad):
    grammar = compose(support("llama3_json"), (WEATHER,), choice, STRICT, None)
    assert admits(grammar.constraint, good)
    assert not admits(grammar.constraint, bad)


def test_auto_admits_free_text_text_then_calls_and_only_valid_calls(admits):
    constraint = compose(support("hermes"), (WEATHER,), "auto", STRICT, None).constraint
    strict_call = "<tool_call>" + call("get_weather", {"city": "Lyon"}) + "</tool_call>"
    assert admits(constraint, "It is sunny / warm, {no call}.")
    assert admits(constraint, "Let me look. " + strict_call)
    assert admits(constraint, strict_call)
    assert not admits(constraint, "<tool_call>" + call("get_weather", {"city": "Paris"}))
    assert not admits(constraint, strict_call + " and text after it")


@pytest.mark.parametrize(("text", "answer", "not_answer"), [
    (OutputConstraint("json_schema", json.dumps({"type": "object", "properties": {"n": {"type": "integer"}},
                                                  "required": ["n"], "additionalProperties": False})),
     '{"n": 4}', '{"m": 4}'),
    (OutputConstraint("regex", "a/b[0-9]+"), "a/b12", "a/c12"),
    (OutputConstraint("lark", 'start: "{" item "}"\nitem: /[0-9]+/'), "{12}", "{x}"),
])
def test_auto_with_a_text_constraint_admits_that_text_or_calls(admits, text, answer, not_answer):
    constraint = compose(support("hermes"), (WEATHER,), "auto", {}, text).constraint
    assert admits(constraint, answer)
    assert not admits(constraint, not_answer)
    assert admits(constraint, "<tool_call>" + call("get_weather", {"anything": 1}) + "</tool_call>")
    assert not admits(constraint, "free text")


@pytest.mark.parametrize(("format_name", "choice"), [
    ("qwen3_coder", "required"), ("harmony", "required"), ("llama3_json", "auto")])
def test_a_format_it_cannot_write_leaves_the_reply_free_with_a_note(format_name, choice):
    grammar = compose(support(format_name), (WEATHER,), choice, STRICT, None)
    assert grammar.constraint is None
    assert f"{format_name} calls" in grammar.notes[0] and "strict tools" in grammar.notes[0]


def test_nothing_strict_and_a_call_possible_leaves_the_reply_free():
    text = OutputConstraint("json_object", "{}")
    assert compose(support("hermes"), (WEATHER,), "required", {}, text).constraint is None
    assert compose(support("hermes"), (WEATHER,), "none", STRICT, text).constraint == text
    assert compose(support("hermes"), (), "auto", STRICT, None).constraint is None
