"""POST /v1/responses bodies (OpenAI's Responses API, the part we serve), and their translation
into a JobRequest.

`input` is a string or a list of items: messages (string or text parts; an earlier reply's output
message may be sent back whole), `function_call` and `function_call_output` items. Function
tools only: built-in tools (web search, file search, computer use...) are refused by name, as is
the state this server does not keep (`previous_response_id`, `store: true`, `background`).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from dflash_local.service.request_fields import (
    MAX_MESSAGES,
    MAX_TOKENS_LIMIT,
    MAX_TOOLS,
    TOOL_NAME_PATTERN,
    DFlashOptions,
    FunctionCall,
    StrictModel,
    Text,
    ToolName,
    at_most,
    joined_text,
    template_call,
    template_tool,
)
from dflash_local.service.validation import shown_value

TEXT_FORMAT = {"type": "text"}
LOGPROBS_INCLUDE = "message.output_text.logprobs"


class TextContent(StrictModel):
    type: Literal["input_text", "output_text"]
    text: Text


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[TextContent]

    def text(self) -> str:
        return joined_text(self.content)


class FunctionCallItem(FunctionCall):  # name, and arguments as an object's JSON text
    type: Literal["function_call"]
    call_id: Text = Field(min_length=1)


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: Text = Field(min_length=1)
    output: Text | list[TextContent]

    def text(self) -> str:
        return joined_text(self.output)


class ReasoningItem(StrictModel):
    """An earlier reply's reasoning sent back: accepted and left out of the prompt (chat
    templates drop earlier turns' reasoning too)."""

    type: Literal["reasoning"]


def _item_kind(value: Any) -> str | None:
    """A message item may leave out its `type`."""
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind)]


class FunctionTool(StrictModel):
    type: str
    name: Text | None = None
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # we do not constrain decoding to the schema; the model may stray

    @field_validator("type")
    @classmethod
    def _function_only(cls, kind: str) -> str:
        if kind != "function":
            raise ValueError(f"{shown_value(kind)} is a built-in tool this server does not run; "
                             f"only function tools")
        return kind

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, schema: dict | None) -> dict | None:
        if schema is not None and schema.get("type") != "object":
            raise ValueError('must be a JSON Schema of "type": "object"')
        return schema

    @model_validator(mode="after")
    def _named(self) -> FunctionTool:
        if not self.name:
            raise ValueError("a function tool needs a name")
        if not re.fullmatch(TOOL_NAME_PATTERN, self.name):  # chat's rule: a forced call writes it as markup
            raise ValueError(f"name {shown_value(self.name)} must be 1 to 64 letters, digits, "
                             f"'_', '.' or '-'")
        return self

    def as_template_tool(self) -> dict:
        return template_tool(self.name, self.description, self.parameters)


class NamedFunction(StrictModel):
    type: Literal["function"]
    name: ToolName


class ResponsesRequest(DFlashOptions):
    model: Text | None = None
    input: Text | Annotated[list[InputItem], at_most(MAX_MESSAGES, "input items per request")]
    instructions: Text | None = None
    tools: Annotated[list[FunctionTool], at_most(MAX_TOOLS, "tools per request")] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    stream: bool = False
    # state and features we do not have: refused unless absent or their no-op
    previous_response_id: Text | None = None
    store: bool | None = None
    background: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None  # extra output to include; only logprobs would ask for any

    @model_validator(mode="after")
    def _what_we_serve(self) -> ResponsesRequest:
        if self.previous_response_id is not None:
            raise ValueError("previous_response_id: this server keeps no responses; send the "
                             "whole conversation in input")
        if self.store:
            raise ValueError("store: this server keeps no responses (store must be false or absent)")
        if self.background:
            raise ValueError("background: not supported (background must be false or absent)")
        if self.text is not None and self.text.get("format", TEXT_FORMAT) != TEXT_FORMAT:
            raise ValueError(f"text.format: only {{\"type\": \"text\"}} (got "
                             f"{shown_value(self.text.get('format'))})")
        if self.top_logprobs or LOGPROBS_INCLUDE in (self.include or []):
            raise ValueError("top_logprobs / include message.output_text.logprobs: not supported "
                             "on /v1/responses (/v1/chat/completions has logprobs)")
        if self.reasoning and any(value is not None for value in self.reasoning.values()):
            raise ValueError(f"reasoning: not supported (got {shown_value(self.reasoning)})")
        if isinstance(self.input, list) and all(isinstance(i, ReasoningItem) for i in self.input):
            raise ValueError("input: give a string or at least one message or function item")
        names = [tool.name for tool in self.tools or []]
        if isinstance(self.tool_choice, NamedFunction) and self.tool_choice.name not in names:
            raise ValueError(f"tool_choice.name: {shown_value(self.tool_choice.name)} is not one "
                             f"of the tools ({', '.join(names) or 'none given'})")
        if self.tool_choice == "required" and not names:
            raise ValueError('tool_choice: "required" needs tools')
        check_call_ids(self.input if isinstance(self.input, list) else [])
        return self

    def template_messages(self) -> list[dict]:
        messages = [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            add_item(messages, item)
        return messages

    def job_tools(self) -> tuple[dict, ...]:
        return tuple(tool.as_template_tool() for tool in self.tools or [])

    def job_tool_choice(self) -> str | dict:
        if isinstance(self.tool_choice, NamedFunction):
            return {"type": "function", "function": {"name": self.tool_choice.name}}
        return self.tool_choice or "auto"


def check_call_ids(items: list) -> None:
    """A function_call_output answers an earlier function_call by its call_id."""
    called: set[str] = set()
    for index, item in enumerate(items):
        if isinstance(item, FunctionCallItem):
            called.add(item.call_id)
        elif isinstance(item, FunctionCallOutputItem) and item.call_id not in called:
            raise ValueError(f"input.{index}.call_id: {shown_value(item.call_id)} answers no "
                             f"earlier function_call item")


def add_item(messages: list[dict], item) -> None:
    """One input item onto the template messages: a function_call joins the assistant message
    before it (or opens one), its output becomes a `tool` message."""
    if isinstance(item, MessageItem):
        role = "system" if item.role == "developer" else item.role
        messages.append({"role": role, "content": item.text()})
    elif isinstance(item, FunctionCallItem):
        call = template_call(item.call_id, item.name, json.loads(item.arguments))
        if not messages or messages[-1]["role"] != "assistant":
            messages.append({"role": "assistant", "content": ""})
        messages[-1].setdefault("tool_calls", []).append(call)
    elif isinstance(item, FunctionCallOutputItem):
        messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
