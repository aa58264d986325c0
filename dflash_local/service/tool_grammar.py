"""Strict tools as a grammar: the Lark (llguidance's dialect) a reply follows so that every call
the model writes is in its target's call format and its arguments follow the tool's schema.

A request's constraint is composed here from its tools, tool_choice, which tools are strict and
the text constraint it asked for (response_format...):
- a forced call (tool_choice "required" or a named tool; the prompt already ends with the call's
  opener, tool_calls.forced_opener): the grammar continues that opener to the call's end, the
  names literal, `%json` embedding each strict tool's schema (any object for a tool not strict);
- tool_choice "auto": text or calls. The text is the text constraint where one was asked, else
  any text that opens no call; then calls, each as above. Only where calls are tagged (hermes):
  elsewhere a call could not be told from text, so nothing is enforced (a note says so).
Formats whose calls are not JSON (qwen3_coder's XML, harmony's channels) are not constrained:
the note says so. `enforced` maps each strict tool's name to the schema its arguments follow
(a custom tool's: its one string, `input`, matching its regex grammar).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from dflash_local.constraints.grammar import JSON_OPTIONS
from dflash_local.events import OutputConstraint
from dflash_local.service.tool_calls import ToolSupport, forced_name

ANY_OBJECT = {"type": "object"}
CALL_FORMATS = ("hermes", "llama3_json")  # whose calls are a JSON object we can write as a grammar
SPACE = '"\\n"'  # between a call's parts, at most a newline (more would let a model loop on it)
OPEN, CLOSE = "<tool_call>", "</tool_call>"  # hermes' markers; its opener may add a newline


@dataclass(frozen=True)
class ToolGrammar:
    """The request's constraint (None: the reply is free) and what was not enforced, for the log."""

    constraint: OutputConstraint | None
    notes: tuple[str, ...] = ()


def literal(text: str) -> str:
    """A Lark string literal (llguidance reads its strings as JSON strings)."""
    return json.dumps(text)


def json_rule(schema: dict | bool) -> str:
    """`%json` with the JSON spacing every schema is compiled with (constraints/grammar.py)."""
    schema = schema if isinstance(schema, dict) else {}  # `true`: any value (`false` is refused)
    return f"%json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}"


def embedded(constraint: OutputConstraint) -> str:
    """A text constraint as one Lark expression."""
    if constraint.kind == "json_schema":
        return json_rule(json.loads(constraint.source))
    if constraint.kind == "json_object":
        return json_rule(ANY_OBJECT)
    if constraint.kind == "regex":
        from llguidance import regex_to_lark  # escapes what a Lark /regex/ cannot hold

        return f"/{regex_to_lark(constraint.source)}/"
    return "%lark {\n" + constraint.source + "\n}"


def _call_rules(tools: tuple[dict, ...], enforced: dict[str, dict], argument_key: str,
                closer: str, skip: str = "") -> list[str]:
    """`call`: one whole call, `{"name": "f", "<key>": {..}}` and `closer` (a Lark expression),
    its first `skip` characters left out (the prompt wrote them)."""
    end = f" sp? {closer}" if closer else ""
    rules = []
    for index, tool in enumerate(tools):
        name = tool["function"]["name"]
        head = json.dumps({"name": name, argument_key: 0})[:-2]  # '{"name": "f", "<key>": '
        arguments = json_rule(enforced.get(name, ANY_OBJECT))
        rules.append(f"call_{index}: {literal(head.removeprefix(skip))} {arguments} "
                     f"sp? \"}}\"{end}")
    alternatives = " | ".join(f"call_{index}" for index in range(len(tools)))
    return [f"call: {alternatives}", *rules, f"sp: {SPACE}"]


def forced_call(support: ToolSupport, tools: tuple[dict, ...], tool_choice: str | dict,
                enforced: dict[str, dict]) -> str:
    """The Lark continuing a forced call's opener (the prompt's end) to the end of its calls."""
    hermes = support.format.name == "hermes"
    key, closer = ("arguments", literal(CLOSE)) if hermes else ("parameters", "")
    name = forced_name(tool_choice)
    if name is not None:  # the prompt wrote the name: the arguments and the closers are left
        end = f" sp? {closer}" if closer else ""
        arguments = json_rule(enforced.get(name, ANY_OBJECT))
        return f"start: {arguments} sp? \"}}\"{end}\nsp: {SPACE}\n"
    if hermes:  # after the opener, a call; then any more, each opened again
        start = f"start: sp? call (sp? {literal(OPEN)} sp? call)*"
        return "\n".join([start, *_call_rules(tools, enforced, key, closer)]) + "\n"
    # llama3_json's opener ends inside the call ('{"name": "'): one call, its remainder
    skip = support.format.forced(None)
    return "\n".join(["start: call", *_call_rules(tools, enforced, key, closer, skip)]) + "\n"


def text_or_calls(tools: tuple[dict, ...], enforced: dict[str, dict],
                  text: OutputConstraint | None) -> str:
    """tool_choice auto on a hermes target: the text asked for, or calls; without a text
    constraint, any text in which no call opens, then any calls."""
    opener = literal(OPEN)
    calls = f"{opener} sp? call (sp? {opener} sp? call)*"
    rules = _call_rules(tools, enforced, "arguments", literal(CLOSE))
    if text is not None:
        return "\n".join([f"start: answer | sp? {calls}", f"answer: {embedded(text)}", *rules]) + "\n"
    free = f"FREE: /(?s:.+)/ & ~/(?s:.*{OPEN}.*)/"  # any text in which no call opens
    # greedy lexemes: free text either ends the reply, or runs up to the first opener (one lexeme)
    opened = f"OPENED: /(?s:.*){OPEN}/ & ~/(?s:.*{OPEN}.+)/"
    start = f"start: FREE | OPENED sp? call (sp? {opener} sp? call)*"
    return "\n".join([start, free, opened, *rules]) + "\n"


def compose(support: ToolSupport, tools: tuple[dict, ...], tool_choice: str | dict,
            enforced: dict[str, dict], text: OutputConstraint | None) -> ToolGrammar:
    """The request's constraint from its tools (template form), the strict ones' schemas and
    its text constraint."""
    if not tools or tool_choice == "none":
        return ToolGrammar(text)
    forced = tool_choice != "auto"
    if not enforced and (forced or text is None):
        return ToolGrammar(None)  # nothing strict, and a call may come: the reply is free
    tool_format = support.format
    format_name = tool_format.name if tool_format is not None else None
    if support.harmony or format_name not in CALL_FORMATS or (not forced and format_name != "hermes"):
        asked = "strict tools" if enforced else "the reply's format"
        note = (f"{asked}: not enforced beside tools on {support.model}, whose {format_name} "
                f"calls this server cannot write as a grammar")
        return ToolGrammar(None, (note,))
    if forced:
        return ToolGrammar(OutputConstraint("lark", forced_call(support, tools, tool_choice, enforced)))
    return ToolGrammar(OutputConstraint("lark", text_or_calls(tools, enforced, text)))
