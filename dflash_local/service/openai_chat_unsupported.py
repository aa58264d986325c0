"""OpenAI chat fields this server does not implement: refused by name, never silently ignored.

A client that sends `logit_bias` and gets the model's own choices back would conclude the model
ignored it. Each field may still carry its no-op value (what some SDKs send by default). Fields that
are not OpenAI's, or only label a request (`user`, `metadata`), stay ignored, as documented.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict

# field -> the values that ask for nothing beyond what we do anyway
NO_OP_VALUES: dict[str, tuple] = {
    "functions": ([],),
    "function_call": ("none",),
    "logit_bias": ({},),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "web_search_options": (),
    "reasoning_effort": (),
}


def _is_no_op(value: Any, no_op: Any) -> bool:
    if isinstance(no_op, int) and not isinstance(no_op, bool):  # 0 and 0.0 alike, not False
        return isinstance(value, int | float) and not isinstance(value, bool) and value == no_op
    return type(value) is type(no_op) and value == no_op


def _refuse_unless_no_op(field: str) -> AfterValidator:
    def check(value: Any) -> Any:
        if value is None or any(_is_no_op(value, no_op) for no_op in NO_OP_VALUES[field]):
            return value
        raise ValueError("not supported by this server (it would be ignored); leave it out")
    return AfterValidator(check)


class UnsupportedOpenAIFields(BaseModel):
    """Mixed into the chat request: each field defaults to None and accepts only its no-op."""

    model_config = ConfigDict(strict=True, extra="ignore")

    functions: Annotated[Any, _refuse_unless_no_op("functions")] = None
    function_call: Annotated[Any, _refuse_unless_no_op("function_call")] = None
    logit_bias: Annotated[Any, _refuse_unless_no_op("logit_bias")] = None
    presence_penalty: Annotated[Any, _refuse_unless_no_op("presence_penalty")] = None
    frequency_penalty: Annotated[Any, _refuse_unless_no_op("frequency_penalty")] = None
    modalities: Annotated[Any, _refuse_unless_no_op("modalities")] = None
    audio: Annotated[Any, _refuse_unless_no_op("audio")] = None
    prediction: Annotated[Any, _refuse_unless_no_op("prediction")] = None
    web_search_options: Annotated[Any, _refuse_unless_no_op("web_search_options")] = None
    reasoning_effort: Annotated[Any, _refuse_unless_no_op("reasoning_effort")] = None


class UnsupportedMessageFields(BaseModel):
    """Mixed into a chat message: OpenAI's legacy function call would be dropped from the prompt."""

    model_config = ConfigDict(strict=True, extra="ignore")

    function_call: Annotated[Any, _refuse_unless_no_op("function_call")] = None
