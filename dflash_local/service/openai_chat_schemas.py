"""POST /v1/chat/completions bodies: the OpenAI chat fields we honour, and our extensions.

OpenAI fields we do not implement are refused by name (openai_chat_unsupported.py), fields
unknown to OpenAI are ignored, as vLLM does. Range checks mirror OpenAI's (temperature in
[0, 2], n == 1). What the other APIs share with chat (text, caps, tools' template form) is
request_fields.py's.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from dflash_local.events import MAX_TOP_LOGPROBS
from dflash_local.service.openai_chat_unsupported import (
    UnsupportedMessageFields,
    UnsupportedOpenAIFields,
)
from dflash_local.service.output_formats import (
    AskedConstraint,
    ChatResponseFormat,
    ConstrainableOptions,
    check_strict_tool,
    one_constraint,
    strict_schema,
)
from dflash_local.service.request_fields import (
    MAX_MESSAGES,
    MAX_TOKENS_LIMIT,
    MAX_TOOLS,
    FunctionCall,
    ObjectSchema,
    StrictModel,
    Text,
    ToolName,
    at_most,
    check_answers_a_call,
    check_stop_strings,
    joined_text,
    template_call,
    template_tool,
)


class TextPart(StrictModel):
    type: Literal["text"]
    text: Text


# --- tools (OpenAI function tools; tool_calls.py takes them to the worker) ---


class FunctionDefinition(StrictModel):
    name: ToolName
    description: Text | None = None
    parameters: ObjectSchema | None = None  # None: no arguments
    strict: bool | None = None  # true: a call's arguments follow `parameters` (tool_grammar.py)


    @model_validator(mode="after")
    def _strict_schema_compiles(self) -> FunctionDefinition:
        if self.strict:
            check_strict_tool(self.parameters, "parameters")
        return self


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition

    def as_template_tool(self) -> dict:
        return template_tool(self.function.name, self.function.description, self.function.parameters)


class ToolChoiceFunction(StrictModel):
    name: ToolName


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: ToolChoiceFunction


class ToolCall(StrictModel):
    id: Text = Field(min_length=1, max_length=200)
    type: Literal["function"]
    function: FunctionCall

    def as_template_call(self) -> dict:
        return template_call(self.id, self.function.name, json.loads(self.function.arguments))


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


class OpenAISampling(ConstrainableOptions):
    """The sampling, stop and stream fields OpenAI's chat and legacy completions share."""

    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: Text | list[Text] | None = None
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("stop")
    @classmethod
    def _bounded_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        check_stop_strings([stop] if isinstance(stop, str) else stop or [])
        return stop

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatCompletionRequest(UnsupportedOpenAIFields, OpenAISampling):
    model: Text | None = None
    messages: Annotated[list[ChatMessage], at_most(MAX_MESSAGES, "messages per request"),
                        Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool | None = None  # each token's logprob (the target's raw distribution)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # and its best alternatives
    # thinking on/off: vLLM's chat_template_kwargs.enable_thinking, or our own field
    chat_template_kwargs: dict[str, Any] | None = None
    thinking: bool | None = None
    tools: Annotated[list[Tool], at_most(MAX_TOOLS, "tools per request")] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    response_format: ChatResponseFormat | None = None
    # OpenAI's "keep this output for distillation": false keeps the reply out of the drafter's
    # recorded replies (a benchmark's held-out prompts); absent: the service's setting
    store: bool | None = None

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatCompletionRequest:
        names = [tool.function.name for tool in self.tools or ()]
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice: names function {self.tool_choice.function.name!r}, "
                             f"which is not among tools ({', '.join(names) or 'none given'})")
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice: 'required' needs tools to choose from")
        return self

    @model_validator(mode="after")
    def _results_answer_calls(self) -> ChatCompletionRequest:
        called: set[str] = set()
        for index, message in enumerate(self.messages):
            called.update(call.id for call in message.tool_calls or ())
            if message.tool_call_id is not None:
                check_answers_a_call(message.tool_call_id, called,
                                     f"messages.{index}.tool_call_id", "tool call")
        return self

    def text_constraint(self) -> AskedConstraint | None:
        """What the reply's text follows: `response_format` or our `structured_outputs`."""
        return one_constraint(
            response_format=self.response_format and self.response_format.constraint(),
            structured_outputs=self.structured_outputs and self.structured_outputs.constraint())

    def enforced_tools(self) -> dict[str, dict]:
        """Each strict tool's name -> the schema its call's arguments follow."""
        return {tool.function.name: strict_schema(tool.function.parameters)
                for tool in self.tools or () if tool.function.strict}

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

    def thinking_mode(self) -> bool | None:
        if self.thinking is not None:
            return self.thinking
        return (self.chat_template_kwargs or {}).get("enable_thinking")

    def requested_logprobs(self) -> int | None:
        """GenerationParams.logprobs: how many alternatives per token, or None for no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

