"""The tools a POST /v1/responses body may carry, what the model is offered for each, and how a
call goes back to the client.

- `function`: offered as is; strict unless `strict: false` (OpenAI's default), its call's
  arguments then follow its schema (tool_grammar.py).
- `namespace` (how Codex groups its MCP and app tools): each function or custom tool inside is
  offered under its own name, the namespace's description before its own; its call comes back
  with `namespace` set, which is how the client routes it. Every offered name must be unique.
- `custom` (free-text input, optionally a Lark or regex grammar: Codex's `apply_patch`): offered
  as a function taking one string, `input`, the grammar shown in its description; its call comes
  back as a `custom_tool_call` item with that string. The grammar is checked (a 400 names what
  fails); a regex grammar is enforced as that string's pattern, a Lark one is only shown.
- built-in tools this server cannot run: those agents send by default and cannot turn off
  (LEFT_OUT_TOOLS) are left out of the prompt with a note; any other is a 400.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator

from dflash_local.service.output_formats import check_strict_tool, checked, strict_schema
from dflash_local.service.request_fields import (
    TOOL_NAME_PATTERN,
    ObjectSchema,
    StrictModel,
    Text,
    ToolName,
    template_tool,
)
from dflash_local.service.validation import shown_value

# Codex sends these on every request, whatever the provider; OpenAI runs them on its side.
LEFT_OUT_TOOLS = ("web_search", "web_search_preview", "tool_search", "image_generation")
CUSTOM_INPUT = "input"  # the one argument a custom tool is offered with
CUSTOM_PARAMETERS = {"type": "object", "required": [CUSTOM_INPUT], "properties": {
    CUSTOM_INPUT: {"type": "string", "description": "the tool's whole input, as free text"}}}


def left_out(kind: str) -> bool:
    """A built-in kind dropped with a note (web_search has dated variants: web_search_2025_08_26)."""
    return kind in LEFT_OUT_TOOLS or kind.startswith(("web_search_", "web_search_preview_"))


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: Text | None = None
    description: Text | None = None
    parameters: ObjectSchema | None = None
    strict: bool | None = None  # None is OpenAI's default, true: the arguments follow `parameters`

    @model_validator(mode="after")
    def _named(self) -> FunctionTool:
        if not self.name:
            raise ValueError("a function tool needs a name")
        if not re.fullmatch(TOOL_NAME_PATTERN, self.name):  # chat's rule: a forced call writes it as markup
            raise ValueError(f"name {shown_value(self.name)} must be 1 to 64 letters, digits, "
                             f"'_', '.' or '-'")
        if self.strict is not False:
            check_strict_tool(self.parameters, "parameters")
        return self

    def enforced(self) -> dict | None:
        """The schema its call's arguments follow, None when not strict."""
        return None if self.strict is False else strict_schema(self.parameters)

    def template(self, context: str) -> dict:
        return template_tool(self.name, _described(context, self.description), self.parameters)


class InputFormat(StrictModel):
    """A custom tool's input: free text, or text in a grammar's language."""

    type: Literal["text", "grammar"]
    syntax: Literal["lark", "regex"] | None = None
    definition: Text | None = None

    @field_validator("definition")
    @classmethod
    def _parsable(cls, definition: str | None, info: ValidationInfo) -> str | None:
        syntax = info.data.get("syntax")
        if definition is not None and syntax is not None:
            checked(syntax, definition)  # a ValueError: "invalid regex: ..."
        return definition

    @model_validator(mode="after")
    def _complete(self) -> InputFormat:
        if self.type == "grammar" and (self.syntax is None or not (self.definition or "").strip()):
            raise ValueError('a "grammar" format needs its syntax ("lark" or "regex") and a definition')
        return self


class CustomTool(StrictModel):
    type: Literal["custom"]
    name: ToolName
    description: Text | None = None
    format: InputFormat | None = None

    def grammar(self) -> InputFormat | None:
        return self.format if self.format is not None and self.format.type == "grammar" else None

    def enforced(self) -> dict | None:
        """A regex grammar as the pattern its one string matches whole; None otherwise."""
        grammar = self.grammar()
        if grammar is None or grammar.syntax != "regex":
            return None
        pattern = {"type": "string", "pattern": f"^(?:{grammar.definition})$"}
        return {"type": "object", "properties": {CUSTOM_INPUT: pattern},
                "required": [CUSTOM_INPUT], "additionalProperties": False}

    def template(self, context: str) -> dict:
        description = _described(context, self.description)
        if (grammar := self.grammar()) is not None:
            description += f"\n\nThe input follows this {grammar.syntax} grammar:\n{grammar.definition}"
        return template_tool(self.name, description.strip(), CUSTOM_PARAMETERS)


def _tool_kind(value: Any) -> str | None:
    """Tags that are no field name stay out of error paths (validation.py): "tools.0.name"."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if not isinstance(kind, str):
        return None
    return {"function": "<function>", "custom": "<custom>", "namespace": "<namespace>"}.get(kind, "<built-in>")


NamespaceMember = Annotated[Annotated[FunctionTool, Tag("<function>")]
                            | Annotated[CustomTool, Tag("<custom>")], Discriminator(_tool_kind)]


class NamespaceTool(StrictModel):
    type: Literal["namespace"]
    name: Text = Field(min_length=1)
    description: Text = ""
    tools: list[NamespaceMember] = Field(min_length=1)


class BuiltInTool(StrictModel):
    """A tool OpenAI runs on its side (web search, file search, computer use...)."""

    type: str

    @field_validator("type")
    @classmethod
    def _left_out_or_refused(cls, kind: str) -> str:
        if not left_out(kind):
            raise ValueError(f"{shown_value(kind)} is a built-in tool this server cannot run; "
                             f"send function, custom or namespace tools")
        return kind


ResponsesTool = Annotated[
    Annotated[FunctionTool, Tag("<function>")] | Annotated[CustomTool, Tag("<custom>")]
    | Annotated[NamespaceTool, Tag("<namespace>")] | Annotated[BuiltInTool, Tag("<built-in>")],
    Discriminator(_tool_kind)]


@dataclass(frozen=True)
class OfferedTool:
    """A tool as the model is offered it, and the client's names for its calls."""

    template: dict  # the chat template's function tool
    custom: bool  # its call goes back as a custom_tool_call item (else a function_call)
    name: str  # the client's name for it: also the name the model calls
    namespace: str | None
    where: str  # its place in the request, for errors ("tools.2.tools.0")
    enforced: dict | None = None  # the schema its call's arguments follow (None: any object)


def offered_tools(tools: list) -> dict[str, OfferedTool]:
    """The model's tools by the name it calls them; a ValueError names a clash."""
    offered: dict[str, OfferedTool] = {}
    for where, tool, namespace in _members(tools):
        name = tool.name
        if name in offered:
            raise ValueError(f"{where}.name: {shown_value(name)} is also the name of "
                             f"{offered[name].where}: a namespace's tools are offered by their own "
                             f"names, so every tool name must be unique")
        context = namespace.description if namespace is not None else ""
        offered[name] = OfferedTool(tool.template(context), isinstance(tool, CustomTool), name,
                                    None if namespace is None else namespace.name, where,
                                    tool.enforced())
    return offered


def _members(tools: list):
    """(where, tool, its namespace or None) for every function and custom tool."""
    for index, tool in enumerate(tools):
        if isinstance(tool, NamespaceTool):
            for member_index, member in enumerate(tool.tools):
                yield f"tools.{index}.tools.{member_index}", member, tool
        elif isinstance(tool, FunctionTool | CustomTool):
            yield f"tools.{index}", tool, None


def tool_notes(tools: list) -> list[str]:
    """What the model is told otherwise than the client asked: dropped tools, Lark grammars
    (shown, not enforced)."""
    notes = [f"tools.{index}: {shown_value(tool.type)} left out: a built-in tool this server "
             f"cannot run (the model is not offered it)"
             for index, tool in enumerate(tools) if isinstance(tool, BuiltInTool)]
    for where, tool, _namespace in _members(tools):
        grammar = tool.grammar() if isinstance(tool, CustomTool) else None
        if grammar is not None and grammar.syntax == "lark":
            notes.append(f"{where}.format: the lark grammar of custom tool "
                         f"{shown_value(tool.name)} is shown to the model, not enforced")
    return notes


def custom_input(arguments: str) -> str:
    """A custom tool call's input from the arguments the model wrote: its `input` string, or the
    arguments' text itself when the model wrote something else."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get(CUSTOM_INPUT), str):
        return value[CUSTOM_INPUT]
    return arguments


def _described(context: str, description: str | None) -> str:
    return "\n\n".join(text for text in (context, description) if text)
