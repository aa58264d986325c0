"""Each family's tool-call markup -> calls and text, whole and split at every character."""

from __future__ import annotations

import json

import pytest

from dflash_local.service.tool_formats import format_for_template, template_uses_tools
from dflash_local.service.tool_stream import ParsedCall, ToolCallSplitter

SCHEMAS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"},
                                                            "days": {"type": "integer"}}},
           "get_time": {"type": "object", "properties": {}}}

# a line of each family's chat template, enough to recognize it
HERMES = "{{- '<tool_call>\\n{\"name\": \"' }}{% if tools %}# Tools{% endif %}"
QWEN3_CODER = "{% if tools %}<tool_call>\n<function={{ name }}>\n<parameter={{ key }}>{% endif %}"
LLAMA3 = '{% if tools %}<|python_tag|>Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}{% endif %}'
HARMONY = "{% if tools %}namespace functions {{ '<|start|>assistant to=functions.' }}{% endif %}"


def split_everywhere(template: str, reply: str) -> list[tuple[str, list[ParsedCall]]]:
    """The reply fed whole, then cut in two at every character, then one character at a time:
    each way's (text, calls)."""
    tool_format = format_for_template(template)
    feeds = [[reply], list(reply)] + [[reply[:cut], reply[cut:]] for cut in range(1, len(reply))]
    results = []
    for pieces in feeds:
        splitter = ToolCallSplitter(tool_format, SCHEMAS)
        text, calls = "", []
        for piece in pieces:
            more, found = splitter.feed(piece)
            text, calls = text + more, calls + found
        more, found = splitter.finish()
        results.append((text + more, calls + found))
    return results


def assert_splits(template: str, reply: str, text: str, calls: list[tuple[str, dict]]) -> None:
    expected = (text, [ParsedCall(name, json.dumps(arguments)) for name, arguments in calls])
    for result in split_everywhere(template, reply):
        assert result == expected


def test_templates_are_told_apart():
    assert format_for_template(HERMES).name == "hermes"
    assert format_for_template(QWEN3_CODER).name == "qwen3_coder"
    assert format_for_template(LLAMA3).name == "llama3_json"
    assert format_for_template(HARMONY).name == "harmony"
    assert format_for_template("{{ messages }}") is None
    assert format_for_template("{{ messages }}", model_type="gpt_oss").name == "harmony"
    assert template_uses_tools(HERMES) and not template_uses_tools("{{ messages }}")


def test_hermes_call_between_texts():
    reply = 'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call> Done.'
    assert_splits(HERMES, reply, "Let me look.  Done.", [("get_weather", {"city": "Paris"})])


def test_hermes_two_calls_and_arguments_as_json_text():
    reply = ('<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>\n'
             '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call>')
    assert_splits(HERMES, reply, "\n", [("get_time", {}), ("get_weather", {"city": "Oslo", "days": 2})])


@pytest.mark.parametrize("reply", [
    '<tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call>',  # bad JSON
    '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>',  # not a tool of the request
    '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}',  # never closed
    'a < b and <tool_call',  # a partial opener at the end
])
def test_malformed_hermes_calls_are_text(reply):
    assert_splits(HERMES, reply, reply, [])


def test_qwen3_coder_parameters_follow_their_schema_types():
    reply = ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
             "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    assert_splits(QWEN3_CODER, reply, "Checking.\n", [("get_weather", {"city": "New York", "days": 3})])


def test_qwen3_coder_malformed_is_text():
    reply = "<tool_call>\n<function=get_weather>\nstray<parameter=city>\nX\n</parameter>\n</function>\n</tool_call>"
    assert_splits(QWEN3_CODER, reply, reply, [])


def test_llama3_json_reply_is_calls():
    reply = ' {"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_time", "parameters": {}}'
    assert_splits(LLAMA3, reply, "", [("get_weather", {"city": "Rome"}), ("get_time", {})])
    assert_splits(LLAMA3, '<|python_tag|>{"name": "get_time", "parameters": {}}', "", [("get_time", {})])


@pytest.mark.parametrize("reply", [
    'The answer is {"name": "get_time", "parameters": {}}',  # JSON after text: text
    '{"name": "get_time", "parameters": {}} and more',  # text after the JSON
    '{"not": "a call"}',
    '{"name": "get_time", "parameters": {',  # cut off
])
def test_llama3_text_stays_text(reply):
    assert_splits(LLAMA3, reply, reply, [])


def test_harmony_call_after_analysis():
    reply = ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
             'to=functions.get_weather <|constrain|>json<|message|>{"city": "Lima"}<|call|>')
    assert_splits(HARMONY, reply, "<|channel|>analysis<|message|>Need weather.<|end|>",
                  [("get_weather", {"city": "Lima"})])


def test_harmony_recipient_in_the_header():
    reply = '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>'
    assert_splits(HARMONY, reply, "", [("get_time", {})])


@pytest.mark.parametrize("reply", [
    "<|channel|>final<|message|>It is sunny.<|return|>",  # an answer, not a call
    '<|channel|>commentary to=functions.get_weather json<|message|>{"city": <|call|>',  # bad JSON
    "<|channel|>commentary to=functions.launch json<|message|>{}<|call|>",  # not a request's tool
    '<|channel|>commentary to=functions.get_time json<|message|>{}',  # never closed
])
def test_harmony_text_and_malformed_calls_stay_text(reply):
    assert_splits(HARMONY, reply, reply, [])


def test_forced_prefix_primes_the_splitter():
    """tool_choice forces a call by ending the prompt with its opener: fed first, it is held."""
    tool_format = format_for_template(HERMES)
    prefix = tool_format.forced("get_weather")
    assert prefix == '<tool_call>\n{"name": "get_weather", "arguments": '
    splitter = ToolCallSplitter(tool_format, SCHEMAS)
    assert splitter.feed(prefix) == ("", [])
    assert splitter.feed('{"city": "Paris"}}\n</tool_call>') == (
        "", [ParsedCall("get_weather", '{"city": "Paris"}')])
