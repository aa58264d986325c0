"""Request bodies as pydantic models: the OpenAI chat fields we honour, and our extensions.

Strict types (no "5" for 5, no true for 1); OpenAI fields we do not implement are refused by
name (unsupported.py), fields unknown to OpenAI are ignored, as vLLM does. Range checks mirror
OpenAI's (temperature in [0, 2], n == 1); numbers are finite; text is valid Unicode. Responses are plain dicts
built in responses.py: they are ours to shape, and dicts stream fastest.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from dflash_local.engines.chat_prompt import unicode_problem
from dflash_local.events import MAX_TOP_LOGPROBS
from dflash_local.service.unsupported import UnsupportedMessageFields, UnsupportedOpenAIFields

MAX_TOKENS_LIMIT = 1_000_000  # beyond any context we serve; the context check comes later
MAX_STOP_STRINGS = 8
# A request's counts, far past what a real conversation sends (a long agent session has hundreds
# to a few thousand messages, an agent with many MCP servers a few hundred tools), yet refused
# before one item is validated: 10^6 empty messages would hold the worker in the template.
MAX_MESSAGES = 10_000
MAX_TOOLS = 1_000
MAX_STOP_CHARS = 1_000  # a stop string longer than any reply we would write cannot match
# a fixed width, or "auto": the calibrated policy picks each round's width (1 = plain fallback)
BlockSize = Annotated[int, Field(ge=1, le=256)] | Literal["auto"]


def check_unicode(value: str) -> str:
    if (problem := unicode_problem(value)) is not None:
        raise ValueError(problem)
    return value


Text = Annotated[str, AfterValidator(check_unicode)]


def joined_text(content: str | list | None) -> str | None:
    """A content given as a string or as text parts (each with `.text`), as one string."""
    if content is None or isinstance(content, str):
        return content
    return "".join(part.text for part in content)


def check_count(values: list, limit: int, what: str) -> None:
    """A list's count within its cap; the error (type "too_many") names the count and the cap."""
    if len(values) > limit:
        raise PydanticCustomError("too_many", "at most {limit} {what}, got {count}",
                                  {"limit": limit, "what": what, "count": len(values)})


def at_most(limit: int, what: str) -> BeforeValidator:
    """A list field's cap, checked before its items are validated."""
    def check(value: Any) -> Any:
        if isinstance(value, list):
            check_count(value, limit, what)
        return value

    return BeforeValidator(check)


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(StrictModel):
    type: Literal["text"]
    text: Text


# --- tools (OpenAI function tools; tool_calls.py takes them to the worker) ---

ToolName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class FunctionDefinition(StrictModel):
    name: ToolName
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of type object; None: no arguments
    strict: bool | None = None  # accepted; the output is not constrained to the schema

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, parameters: dict | None) -> dict | None:
        if parameters is not None and parameters.get("type") != "object":
            raise ValueError(f"must be a JSON Schema of type \"object\", got type "
                             f"{json.dumps(parameters.get('type'))}")
        return parameters


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition

    def as_template_tool(self) -> dict:
        return template_tool(self.function.name, self.function.description, self.function.parameters)


def template_tool(name: str, description: str | None, parameters: dict | None) -> dict:
    """A function tool as chat templates take it; every endpoint's tools end up in this form,
    so one conversation renders the same prompt whichever API it came through."""
    return {"type": "function", "function": {
        "name": name, "description": description or "",
        "parameters": parameters or {"type": "object", "properties": {}}}}


class ToolChoiceFunction(StrictModel):
    name: ToolName


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: ToolChoiceFunction


class FunctionCall(StrictModel):
    name: ToolName
    arguments: Text  # an object's JSON text, as OpenAI sends it

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str) -> str:
        try:
            value = json.loads(arguments)
        except ValueError as exc:
            raise ValueError(f"must be an object's JSON text: {exc}") from None
        if not isinstance(value, dict):
            # pydantic words a ValueError as this field's error (a TypeError would escape it)
            raise ValueError(f"must be an object's JSON text, got a {type(value).__name__}")  # noqa: TRY004
        return arguments


class ToolCall(StrictModel):
    id: Text = Field(min_length=1, max_length=200)
    type: Literal["function"]
    function: FunctionCall

    def as_template_call(self) -> dict:
        return template_call(self.id, self.function.name, json.loads(self.function.arguments))


def template_call(call_id: str, name: str, arguments: dict) -> dict:
    """An earlier reply's call as chat templates take it (arguments a dict), whichever API sent it."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


class ChatMessage(UnsupportedMessageFields, StrictModel):
    # in this order: each field's check reads the ones before it
    role: Literal["system", "developer", "user", "assistant", "tool"]
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: Text | None = Field(None, min_length=1, max_length=200,
                                      validate_default=True)  # the call a tool message answers
    # None (or left out, as OpenAI allows) only for an assistant message with tool_calls
    content: Text | list[TextPart] | None = Field(None, validate_default=True)

    @field_validator("tool_calls")
    @classmethod
    def _only_an_assistant_calls(cls, calls: list | None, info: ValidationInfo) -> list | None:
        role = info.data.get("role")
        if calls is not None and role != "assistant":
            raise ValueError(f"only an assistant message calls tools (this one's role is {role!r})")
        return calls

    @field_validator("tool_call_id")
    @classmethod
    def _a_tool_message_names_its_call(cls, call_id: str | None, info: ValidationInfo) -> str | None:
        role = info.data.get("role")
        if role == "tool" and call_id is None:
            raise ValueError("a tool message needs the id of the call it answers")
        if role != "tool" and call_id is not None:
            raise ValueError(f"only a tool message has one (this one's role is {role!r})")
        return call_id

    @field_validator("content")
    @classmethod
    def _null_only_beside_calls(cls, content, info: ValidationInfo):
        if content is None and not info.data.get("tool_calls"):
            raise ValueError("content is required: null, or leaving it out, is only allowed in "
                             "an assistant message with tool_calls")
        return content

    def as_template_message(self) -> dict:
        text = joined_text(self.content)
        # chat templates know "system"; "developer" is OpenAI's newer name for it
        message = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            message["tool_calls"] = [call.as_template_call() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class StreamOptions(StrictModel):
    include_usage: bool = False


class DFlashOptions(StrictModel):
    """Our extensions, the same on every generating endpoint (chat, messages, responses)."""

    speculative: bool | None = None
    block_size: BlockSize | None = None
    prompt_lookup: bool | None = None  # with block_size "auto": may verify prompt-lookup drafts
    tree: bool | None = None  # verify a tree of drafts per round (default on)
    draft_window: int | None = Field(None, ge=1)  # context rows the drafter keeps (local engines)


def check_stop_strings(stops: list[str]) -> None:
    check_count(stops, MAX_STOP_STRINGS, "stop strings per request")
    for index, text in enumerate(stops):
        if not 1 <= len(text) <= MAX_STOP_CHARS:
            raise ValueError(f"stop string {index} has {len(text)} characters: each must have "
                             f"1 to {MAX_STOP_CHARS}")


class ChatCompletionRequest(UnsupportedOpenAIFields, DFlashOptions):
    model: Text | None = None
    messages: Annotated[list[ChatMessage], at_most(MAX_MESSAGES, "messages per request"),
                        Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: Text | list[Text] | None = None
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | None = None  # each token's logprob (the target's raw distribution)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # and its best alternatives
    # thinking on/off: vLLM's chat_template_kwargs.enable_thinking, or our own field
    chat_template_kwargs: dict[str, Any] | None = None
    thinking: bool | None = None
    tools: Annotated[list[Tool], at_most(MAX_TOOLS, "tools per request")] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatCompletionRequest:
        names = [tool.function.name for tool in self.tools or ()]
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice: names function {self.tool_choice.function.name!r}, "
                             f"which is not among tools ({', '.join(names) or 'none given'})")
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice: 'required' needs tools to choose from")
        return self

    def tool_choice_value(self) -> str | dict:
        """tool_choice as JobRequest takes it (default "auto")."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.model_dump()
        return self.tool_choice or "auto"

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError(f"top_logprobs ({self.top_logprobs}) requires logprobs: true "
                             f"(got logprobs {self.logprobs!r})")
        if self.max_tokens and self.max_completion_tokens and self.max_tokens != self.max_completion_tokens:
            raise ValueError(f"max_tokens ({self.max_tokens}) and max_completion_tokens "
                             f"({self.max_completion_tokens}) disagree")
        template_thinking = (self.chat_template_kwargs or {}).get("enable_thinking")
        if template_thinking is not None and not isinstance(template_thinking, bool):
            raise ValueError(f"chat_template_kwargs.enable_thinking must be a boolean, got "
                             f"{template_thinking!r}")
        if None not in (template_thinking, self.thinking) and template_thinking != self.thinking:
            raise ValueError(f"thinking ({self.thinking}) and chat_template_kwargs.enable_thinking "
                             f"({template_thinking}) disagree")
        return self

    @field_validator("stop")
    @classmethod
    def _bounded_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        check_stop_strings([stop] if isinstance(stop, str) else stop or [])
        return stop

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def thinking_mode(self) -> bool | None:
        if self.thinking is not None:
            return self.thinking
        return (self.chat_template_kwargs or {}).get("enable_thinking")

    def requested_logprobs(self) -> int | None:
        """GenerationParams.logprobs: how many alternatives per token, or None for no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class LoadRequest(StrictModel):
    """Load a catalog pair by id, or a target (+ drafter) by repo id from the local cache."""

    model_config = ConfigDict(strict=True, extra="forbid")
    pair: str | None = Field(None, min_length=1, max_length=200)
    engine: str | None = Field(None, min_length=1, max_length=40)
    target: str | None = Field(None, min_length=1, max_length=200)
    drafter: str | None = Field(None, min_length=1, max_length=200)
    block_size: BlockSize | None = None  # default block size for requests
    draft_window: int | None = Field(None, ge=1)  # default draft window (None: the catalog's)
    recalibrate: bool = False  # measure this machine's round costs again (block size auto)

    @model_validator(mode="after")
    def _one_form(self) -> LoadRequest:
        if (self.pair is None) == (self.target is None):
            raise ValueError("give either pair (a catalog id) or target (a repo id), not both")
        if self.pair is not None and self.drafter is not None:
            raise ValueError("drafter goes with target, not with pair")
        return self


class DownloadRequest(StrictModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    pair: str = Field(min_length=1, max_length=200)
    context_tokens: int = Field(4096, ge=1, le=10_000_000)  # for the will-it-fit estimate
