"""How each model family writes a tool call, and which family a chat template speaks.

One ToolFormat per family: the text that opens a call's markup, what closes it, how a whole
call (opener to closer) becomes (name, arguments), and the prompt suffix that forces a call
(tool_choice "required" or a named function). The sources each format follows:

- hermes: `<tool_call>{"name": .., "arguments": {..}}</tool_call>`, as the chat templates of
  Qwen2.5 and Qwen3 write it (their tokenizer_config.json chat_template, the "# Tools" section;
  NousResearch's Hermes-2-Pro function-calling format it comes from).
- qwen3_coder: `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n
  </tool_call>`, as the chat templates of Qwen3-Coder, Qwen3-Next-Coder and Qwen3.5/3.6 write it.
- llama3_json: a reply that is `{"name": .., "parameters": {..}}` (optionally after
  `<|python_tag|>`, several joined by ";"), Meta's Llama 3.1 "JSON based tool calling" prompt
  format (llama-models, models/llama3_1/prompt_format.md).
- harmony: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{..}<|call|>`
  (the recipient may sit in the header `<|start|>assistant to=functions.NAME`), OpenAI's
  harmony response format for gpt-oss (openai/harmony, docs/format.md, "Function calling").
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

Calls = list[tuple[str, dict]]
Schemas = dict[str, dict]  # tool name -> its parameters schema


@dataclass(frozen=True)
class ToolFormat:
    name: str
    openers: tuple[str, ...]  # text that begins a call's markup
    closers: tuple[str, ...]  # text that ends it; empty: the reply's end does
    parse: Callable[[str, Schemas], Calls | None]  # a whole call's markup -> calls; None: not one
    forced: Callable[[str | None], str]  # tool name (None: any) -> the prompt suffix forcing a call
    reply_start_only: bool = False  # an opener counts only at the reply's start (after whitespace)
    # markup begun by an opener that can no longer be a call (released as text at once)
    not_a_call: Callable[[str], bool] = field(default=lambda markup: False)


def _object(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _named_call(value: dict | None, argument_keys: tuple[str, ...]) -> tuple[str, dict] | None:
    """{"name": str, <one of argument_keys>: object or its JSON text} -> (name, arguments)."""
    if value is None or not isinstance(value.get("name"), str):
        return None
    arguments = next((value[key] for key in argument_keys if key in value), {})
    if isinstance(arguments, str):
        arguments = _object(arguments)
    return (value["name"], arguments) if isinstance(arguments, dict) else None


def _inner(markup: str, opener: str, closer: str) -> str:
    return markup[len(opener): len(markup) - len(closer)].strip()


# --- hermes and qwen3_coder: the same <tool_call> tags around a JSON or an XML-like body ---

FUNCTION_XML = re.compile(r"<function=([^>\n]+)>(.*)</function>", re.DOTALL)
PARAMETER_XML = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _xml_value(text: str, schema: dict) -> object:
    """A parameter's text as its schema's type: strings stay text, the rest is read as JSON."""
    if schema.get("type", "string") == "string":
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def _function_xml(body: str, schemas: Schemas) -> tuple[str, dict] | None:
    match = FUNCTION_XML.fullmatch(body)
    if match is None:
        return None
    name, inside = match[1].strip(), match[2]
    if PARAMETER_XML.sub("", inside).strip():
        return None  # text between parameters: not the format
    properties = schemas.get(name, {}).get("properties", {})
    return name, {key.strip(): _xml_value(value, properties.get(key.strip(), {}))
                  for key, value in PARAMETER_XML.findall(inside)}


def _parse_tool_call_tags(markup: str, schemas: Schemas) -> Calls | None:
    body = _inner(markup, "<tool_call>", "</tool_call>")
    call = (_function_xml(body, schemas) if body.startswith("<function=")
            else _named_call(_object(body), ("arguments", "parameters")))
    return [call] if call else None


def _hermes_forced(newline: str) -> Callable[[str | None], str]:
    def forced(name: str | None) -> str:
        opener = "<tool_call>" + newline
        return opener if name is None else opener + '{"name": ' + json.dumps(name) + ', "arguments": '
    return forced


def _qwen3_coder_forced(name: str | None) -> str:
    return "<tool_call>\n" if name is None else f"<tool_call>\n<function={name}>\n"


# --- llama3_json: the whole reply is the call(s) ---

def _parse_llama3_json(markup: str, schemas: Schemas) -> Calls | None:
    text = markup.strip().removeprefix("<|python_tag|>").strip()
    decoder, calls, position = json.JSONDecoder(), [], 0
    while position < len(text):
        try:
            value, position = decoder.raw_decode(text, position)
        except ValueError:
            return None
        call = _named_call(value if isinstance(value, dict) else None, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)
        rest = text[position:].lstrip()
        if rest and not rest.startswith(";"):
            return None
        position = len(text) - len(rest.removeprefix(";").lstrip())
    return calls or None


def _llama3_forced(name: str | None) -> str:
    return '{"name": "' if name is None else '{"name": ' + json.dumps(name) + ', "parameters": '


# --- harmony (gpt-oss) ---

HARMONY_RECIPIENT = re.compile(r"to=functions\.([\w.-]+)")


def parse_harmony(markup: str, schemas: Schemas) -> Calls | None:
    header, separator, body = markup.removesuffix("<|call|>").partition("<|message|>")
    recipient = HARMONY_RECIPIENT.search(header)
    if not separator or recipient is None:
        return None
    arguments = _object(body.strip())
    return [(recipient[1], arguments)] if arguments is not None else None


def _harmony_not_a_call(markup: str) -> bool:
    header, separator, body = markup.partition("<|message|>")
    if not separator:
        return "<|end|>" in header or "<|return|>" in header
    return "to=functions." not in header or any(end in body for end in ("<|end|>", "<|return|>", "<|start|>"))


def _harmony_forced(name: str | None) -> str:
    recipient = "<|channel|>commentary to=functions."
    return recipient if name is None else f"{recipient}{name} <|constrain|>json<|message|>"


def format_for_template(template: str | dict | None, model_type: str | None = None) -> ToolFormat | None:
    """The family a chat template writes calls in (None: none we parse), judged from its text."""
    text = "\n".join(template.values()) if isinstance(template, dict) else template or ""
    if "<function=" in text and "<tool_call>" in text:
        return ToolFormat("qwen3_coder", ("<tool_call>",), ("</tool_call>",),
                          _parse_tool_call_tags, _qwen3_coder_forced)
    if "<tool_call>" in text:
        newline = "\n" if "<tool_call>\\n" in text or "<tool_call>\n" in text else ""
        return ToolFormat("hermes", ("<tool_call>",), ("</tool_call>",),
                          _parse_tool_call_tags, _hermes_forced(newline))
    if "to=functions" in text or model_type == "gpt_oss":
        return ToolFormat("harmony", ("<|start|>", "<|channel|>"), ("<|call|>",),
                          parse_harmony, _harmony_forced, not_a_call=_harmony_not_a_call)
    if "<|python_tag|>" in text or '"parameters": dictionary of argument name' in text:
        return ToolFormat("llama3_json", ("<|python_tag|>", "{"), (), _parse_llama3_json,
                          _llama3_forced, reply_start_only=True)
    return None


def template_uses_tools(template: str | dict | None) -> bool:
    text = "\n".join(template.values()) if isinstance(template, dict) else template or ""
    return "tools" in text
