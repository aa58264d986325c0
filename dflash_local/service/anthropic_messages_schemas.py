"""POST /v1/messages bodies (Anthropic's Messages API), and their translation into a JobRequest.

Anthropic's fields as its API defines them: `max_tokens` and `model` required, `system` a
string or text blocks, content blocks text / tool_use / tool_result, tools with an
`input_schema` (`strict: true`: a call's input follows it), tool_choice auto / any / tool / none,
`output_config.format` (or its beta name `output_format`): the JSON Schema the reply's text follows. What we cannot honour (images, documents,
thinking blocks, server tools) is refused by name; `metadata` only labels a request and is ignored.
A message of role "system" (text only) may stand anywhere in `messages`, as agents send it; it goes
where the target's template allows (system_turns.py).
The messages become Hugging Face template messages (worker.JobRequest's form): tool_use blocks an
assistant's `tool_calls`, tool_result blocks `tool` messages.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from dflash_local.service.output_formats import (
    AnthropicJsonFormat,
    AnthropicOutputConfig,
    AskedConstraint,
    ConstrainableOptions,
    check_strict_tool,
    one_constraint,
)
from dflash_local.service.request_fields import (
    MAX_MESSAGES,
    MAX_TOKENS_LIMIT,
    MAX_TOOLS,
    ObjectSchema,
    StrictModel,
    Text,
    at_most,
    check_answers_a_call,
    check_stop_strings,
    joined_text,
    template_call,
    template_tool,
)
from dflash_local.service.system_turns import SystemTurns, place_system_turns
from dflash_local.service.validation import shown_value

TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,128}")  # Anthropic's rule for a tool's name
CUSTOM_TOOL_TYPES = (None, "custom")  # the others are Anthropic's server tools (web search, bash...)
# a user's tool_result blocks are template messages each: a message's blocks are capped too
MAX_CONTENT_BLOCKS = 1_000


class TextBlock(StrictModel):
    type: Literal["text"]
    text: Text


class ToolUseBlock(StrictModel):
    type: Literal["tool_use"]
    id: Text = Field(min_length=1)
    name: Text = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: Text = Field(min_length=1)
    content: Text | list[TextBlock] = ""
    is_error: bool = False

    def text(self) -> str:
        return joined_text(self.content)


class ThinkingBlock(StrictModel):
    """An earlier reply's reasoning, sent back by agents: accepted in an assistant message and
    left out of the prompt, as Anthropic leaves earlier turns' thinking out of the context."""

    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class AnthropicMessage(StrictModel):
    role: Literal["user", "assistant", "system"]
    content: Text | Annotated[list[Block], at_most(MAX_CONTENT_BLOCKS, "content blocks per message")]

    @field_validator("content")
    @classmethod
    def _holds_something(cls, content: str | list) -> str | list:
        if isinstance(content, list) and all(isinstance(block, ThinkingBlock) for block in content):
            raise ValueError("holds neither text nor tool blocks: give a string, or text, "
                             "tool_use or tool_result blocks")
        return content


class AnthropicTool(StrictModel):
    type: str | None = None
    name: Text
    description: Text | None = None
    input_schema: ObjectSchema
    strict: bool | None = None  # true: a call's input follows input_schema (tool_grammar.py)

    @field_validator("type")
    @classmethod
    def _custom_only(cls, kind: str | None) -> str | None:
        if kind not in CUSTOM_TOOL_TYPES:
            raise ValueError(f"{shown_value(kind)} is a server tool this server does not run; "
                             f"only custom tools (name, description, input_schema)")
        return kind

    @field_validator("name")
    @classmethod
    def _valid_name(cls, name: str) -> str:
        if not TOOL_NAME.fullmatch(name):  # match's "$" would let a trailing newline through
            raise ValueError("must be 1 to 128 letters, digits, '_' or '-'")
        return name

    @model_validator(mode="after")
    def _strict_schema_compiles(self) -> AnthropicTool:
        if self.strict:
            check_strict_tool(self.input_schema, "input_schema")
        return self

    def as_template_tool(self) -> dict:
        return template_tool(self.name, self.description, self.input_schema)


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None
    disable_parallel_tool_use: bool | None = None  # a hint; the model may call one or several

    @model_validator(mode="after")
    def _name_with_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('name goes with type "tool", and only with it')
        return self


class ThinkingConfig(StrictModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None  # the template's thinking switch has no budget


class MessagesRequest(ConstrainableOptions):
    model: Text
    max_tokens: int = Field(ge=1, le=MAX_TOKENS_LIMIT)
    messages: Annotated[list[AnthropicMessage], at_most(MAX_MESSAGES, "messages per request"),
                        Field(min_length=1)]
    system: Text | list[TextBlock] | None = None
    tools: Annotated[list[AnthropicTool], at_most(MAX_TOOLS, "tools per request")] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: list[Text] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    thinking: ThinkingConfig | None = None
    output_config: AnthropicOutputConfig | None = None
    output_format: AnthropicJsonFormat | None = None  # output_config.format's beta name

    @field_validator("stop_sequences")
    @classmethod
    def _bounded_stops(cls, stops: list[str] | None) -> list[str] | None:
        check_stop_strings(stops or [])
        return stops

    @model_validator(mode="after")
    def _consistent(self) -> MessagesRequest:
        names = [tool.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError(f"tools: each name once (got {names})")
        choice = self.tool_choice
        if choice is not None and choice.type in ("any", "tool") and not names:
            raise ValueError(f'tool_choice: type "{choice.type}" needs tools')
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise ValueError(f"tool_choice.name: {shown_value(choice.name)} is not one of the "
                             f"tools ({', '.join(names)})")
        check_tool_blocks(self.messages)
        return self

    def template_messages(self, turns: SystemTurns = SystemTurns.ANYWHERE, model: str = "") -> list[dict]:
        """The conversation as template messages, its system turns where `turns` (the template
        of `model`) allows them."""
        system = joined_text(self.system)
        sourced = [] if system is None else [("system", {"role": "system", "content": system})]
        for index, message in enumerate(self.messages):
            sourced += [(f"messages.{index}", part) for part in template_messages(message)]
        return place_system_turns(sourced, turns, model)

    def job_tools(self) -> tuple[dict, ...]:
        return tuple(tool.as_template_tool() for tool in self.tools or [])

    def job_tool_choice(self) -> str | dict:
        if self.tool_choice is None:
            return "auto"
        if self.tool_choice.type == "tool":
            return {"type": "function", "function": {"name": self.tool_choice.name}}
        return {"any": "required"}.get(self.tool_choice.type, self.tool_choice.type)

    def text_constraint(self) -> AskedConstraint | None:
        """What the reply's text follows: output_config.format, output_format or structured_outputs."""
        given = self.output_config.format if self.output_config is not None else None
        return one_constraint(**{
            "output_config.format": given and given.constraint(),
            "output_format": self.output_format and self.output_format.constraint(),
            "structured_outputs": self.structured_outputs and self.structured_outputs.constraint()})

    def enforced_tools(self) -> dict[str, dict]:
        """Each strict tool's name -> the schema its call's input follows."""
        return {tool.name: tool.input_schema for tool in self.tools or [] if tool.strict}

    def thinking_mode(self) -> bool | None:
        return None if self.thinking is None else self.thinking.type != "disabled"


def check_tool_blocks(messages: list[AnthropicMessage]) -> None:
    """tool_use only from the assistant; a tool_result answers an earlier tool_use by its id."""
    called: set[str] = set()
    for index, message in enumerate(messages):
        for at, block in enumerate(message.content if isinstance(message.content, list) else []):
            where = f"messages.{index}.content.{at}"
            if isinstance(block, ToolUseBlock):
                if message.role != "assistant":
                    raise ValueError(f"{where}: a tool_use block belongs in an assistant message")
                called.add(block.id)
            elif isinstance(block, ThinkingBlock) and message.role != "assistant":
                raise ValueError(f"{where}: a {block.type} block belongs in an assistant message")
            elif isinstance(block, ToolResultBlock):
                if message.role != "user":
                    raise ValueError(f"{where}: a tool_result block belongs in a user message")
                check_answers_a_call(block.tool_use_id, called, f"{where}.tool_use_id",
                                     "tool_use block")


def template_messages(message: AnthropicMessage) -> list[dict]:
    """One Anthropic message as template messages: a user's tool_result blocks become `tool`
    messages (in their order, text between them a user message), an assistant's tool_use
    blocks its `tool_calls`."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    if message.role == "assistant":
        text = "".join(block.text for block in message.content if isinstance(block, TextBlock))
        calls = [template_call(block.id, block.name, block.input)
                 for block in message.content if isinstance(block, ToolUseBlock)]
        return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]
    out: list[dict] = []  # a user's or a system's: text, and a user's tool_result blocks
    for block in message.content:
        if isinstance(block, ToolResultBlock):
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
        elif out and out[-1]["role"] == message.role:
            out[-1]["content"] += block.text
        else:
            out.append({"role": message.role, "content": block.text})
    return out


class CountTokensRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: a Messages body without `max_tokens`."""

    max_tokens: int = Field(1, ge=1, le=MAX_TOKENS_LIMIT)
