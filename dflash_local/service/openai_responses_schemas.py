"""POST /v1/responses bodies (OpenAI's Responses API, the part we serve), and their translation
into a JobRequest.

`input` is a string or a list of items: messages (string or text parts; an earlier reply's output
message may be sent back whole; system and developer messages anywhere), `function_call` and
`custom_tool_call` items and their outputs. Tools are openai_responses_tools.py's. `reasoning`:
its effort switches the template's thinking (off for "none" and "minimal"); no summary is
written. Refused: the state this server does not keep (`previous_response_id`, `store: true`,
`background`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, PrivateAttr, Tag, model_validator

from dflash_local.service.openai_responses_tools import (
    CUSTOM_INPUT,
    OfferedTool,
    ResponsesTool,
    offered_tools,
    tool_notes,
)
from dflash_local.service.output_formats import (
    AskedConstraint,
    ConstrainableOptions,
    ResponsesText,
    one_constraint,
)
from dflash_local.service.request_fields import (
    MAX_MESSAGES,
    MAX_TOKENS_LIMIT,
    MAX_TOOLS,
    FunctionCall,
    StrictModel,
    Text,
    ToolName,
    at_most,
    check_answers_a_call,
    joined_text,
    template_call,
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


class CallOutputItem(StrictModel):
    """A tool's result: `function_call_output` or `custom_tool_call_output`."""

    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: Text = Field(min_length=1)
    output: Text | list[TextContent]

    def text(self) -> str:
        return joined_text(self.output)


class CustomToolCallItem(StrictModel):
    """An earlier reply's custom tool call: the template sees it as a call with one argument."""

    type: Literal["custom_tool_call"]
    call_id: Text = Field(min_length=1)
    name: ToolName
    input: Text


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
    | Annotated[CustomToolCallItem, Tag("custom_tool_call")]
    | Annotated[CallOutputItem, Tag("function_call_output")]
    | Annotated[CallOutputItem, Tag("custom_tool_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind)]


class NamedTool(StrictModel):
    type: Literal["function", "custom"]
    name: ToolName


# A binary thinking switch: OpenAI's lowest efforts mean (almost) no reasoning
THINKING_BY_EFFORT = {"none": False, "minimal": False, "low": True, "medium": True, "high": True,
                      "xhigh": True}
Summary = Literal["auto", "concise", "detailed"]


class ReasoningSettings(StrictModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Summary | None = None
    generate_summary: Summary | None = None  # summary's older name

    def thinking(self) -> bool | None:
        return None if self.effort is None else THINKING_BY_EFFORT[self.effort]

    def notes(self) -> list[str]:
        summary = self.summary or self.generate_summary
        if summary is None:
            return []
        note = (f"reasoning.summary {shown_value(summary)}: no summary is written (a thinking "
                f"pair's reasoning stays in its reply's text)")
        return [note]


class ResponsesRequest(ConstrainableOptions):
    model: Text | None = None
    input: Text | Annotated[list[InputItem], at_most(MAX_MESSAGES, "input items per request")]
    instructions: Text | None = None
    tools: Annotated[list[ResponsesTool], at_most(MAX_TOOLS, "tools per request")] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedTool | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    stream: bool = False
    reasoning: ReasoningSettings | None = None
    # state and features we do not have: refused unless absent or their no-op
    previous_response_id: Text | None = None
    store: bool | None = None
    background: bool | None = None
    text: ResponsesText | None = None  # its format: what the reply's text follows
    top_logprobs: int | None = None
    include: list[str] | None = None  # extra output to include; only logprobs would ask for any
    _offered: dict[str, OfferedTool] = PrivateAttr(default_factory=dict)  # offered_tools()

    @model_validator(mode="after")
    def _what_we_serve(self) -> ResponsesRequest:
        if self.previous_response_id is not None:
            raise ValueError("previous_response_id: this server keeps no responses; send the "
                             "whole conversation in input")
        if self.store:
            raise ValueError("store: this server keeps no responses (store must be false or absent)")
        if self.background:
            raise ValueError("background: not supported (background must be false or absent)")
        if self.top_logprobs or LOGPROBS_INCLUDE in (self.include or []):
            raise ValueError("top_logprobs / include message.output_text.logprobs: not supported "
                             "on /v1/responses (/v1/chat/completions has logprobs)")
        if isinstance(self.input, list) and all(isinstance(i, ReasoningItem) for i in self.input):
            raise ValueError("input: give a string or at least one message or function item")
        self._offered = offered_tools(self.tools or [])
        self._check_tool_choice(list(self._offered))
        check_call_ids(self.input if isinstance(self.input, list) else [])
        return self

    def _check_tool_choice(self, names: list[str]) -> None:
        if isinstance(self.tool_choice, NamedTool) and self.tool_choice.name not in names:
            raise ValueError(f"tool_choice.name: {shown_value(self.tool_choice.name)} is not one "
                             f"of the tools ({', '.join(names) or 'none given'})")
        if self.tool_choice == "required" and not names:
            raise ValueError('tool_choice: "required" needs tools')

    def offered_tools(self) -> dict[str, OfferedTool]:
        """The model's tools by name (namespaces flattened, custom tools as functions), built
        once, when the request is validated."""
        return self._offered

    def notes(self) -> list[str]:
        """Where the model is told otherwise than asked (openai_responses_tools.py, reasoning)."""
        return tool_notes(self.tools or []) + (self.reasoning.notes() if self.reasoning else [])

    def thinking(self) -> bool | None:
        return self.reasoning.thinking() if self.reasoning else None

    def template_messages(self) -> list[dict]:
        messages = [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            add_item(messages, item)
        return messages

    def job_tools(self) -> tuple[dict, ...]:
        return tuple(tool.template for tool in self.offered_tools().values())

    def text_format(self) -> dict:
        """The format as the response echoes it."""
        given = self.text.format if self.text is not None else None
        return TEXT_FORMAT if given is None else given.model_dump(by_alias=True, exclude_none=True)

    def text_constraint(self) -> AskedConstraint | None:
        """What the reply's text follows: `text.format` or our `structured_outputs`."""
        given = self.text.format if self.text is not None else None
        return one_constraint(
            **{"text.format": given and given.constraint(),
               "structured_outputs": self.structured_outputs and self.structured_outputs.constraint()})

    def enforced_tools(self) -> dict[str, dict]:
        """Each strict tool's name -> the schema its call's arguments follow."""
        return {name: tool.enforced for name, tool in self.offered_tools().items()
                if tool.enforced is not None}

    def job_tool_choice(self) -> str | dict:
        if isinstance(self.tool_choice, NamedTool):
            return {"type": "function", "function": {"name": self.tool_choice.name}}
        return self.tool_choice or "auto"


def check_call_ids(items: list) -> None:
    """A call's output answers an earlier call by its call_id."""
    called: set[str] = set()
    for index, item in enumerate(items):
        if isinstance(item, FunctionCallItem | CustomToolCallItem):
            called.add(item.call_id)
        elif isinstance(item, CallOutputItem):
            check_answers_a_call(item.call_id, called, f"input.{index}.call_id",
                                 f"{item.type.removesuffix('_output')} item")


def add_item(messages: list[dict], item) -> None:
    """One input item onto the template messages: a call joins the assistant message before it
    (or opens one), its output becomes a `tool` message."""
    if isinstance(item, MessageItem):
        role = "system" if item.role == "developer" else item.role
        messages.append({"role": role, "content": item.text()})
    elif isinstance(item, FunctionCallItem | CustomToolCallItem):
        arguments = (json.loads(item.arguments) if isinstance(item, FunctionCallItem)
                     else {CUSTOM_INPUT: item.input})
        if not messages or messages[-1]["role"] != "assistant":
            messages.append({"role": "assistant", "content": ""})
        messages[-1].setdefault("tool_calls", []).append(template_call(item.call_id, item.name, arguments))
    elif isinstance(item, CallOutputItem):
        messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
