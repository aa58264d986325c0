"""POST /v1/completions bodies: OpenAI's legacy completion fields we honour, and our extensions.

A prompt is text, token ids, or a list of either (one choice each, in order; a list is not
streamed). OpenAI fields we cannot honour (`suffix`, `best_of` > 1, `n` > 1, penalties, a logit
bias) are refused by name unless they carry their no-op value; fields unknown to OpenAI are
ignored, as vLLM does. What the other APIs share (text, caps, stops, `dflash` options) is
request_fields.py's; `structured_outputs` (a regex or a Lark grammar the continuation follows)
output_formats.py's.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator

from dflash_local.events import MAX_TOP_LOGPROBS
from dflash_local.service.openai_chat_schemas import OpenAISampling
from dflash_local.service.output_formats import (
    AskedConstraint,
    one_constraint,
)
from dflash_local.service.request_fields import (
    MAX_TOKENS_LIMIT,
    Text,
    check_count,
)

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for a legacy completion
MAX_PROMPTS = 64  # a list of prompts runs one generation after another
TokenIds = list[Annotated[int, Field(ge=0)]]
# field -> the values that ask for nothing beyond what we do anyway
NO_OP_VALUES: dict[str, tuple] = {
    "suffix": ("",), "best_of": (1,), "logit_bias": ({},),
    "presence_penalty": (0,), "frequency_penalty": (0,),
}


class CompletionRequest(OpenAISampling):
    model: Text | None = None
    prompt: Text | TokenIds | list[Text] | list[TokenIds]
    max_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS_LIMIT)
    echo: bool = False  # the reply's text (and logprobs) begin with the prompt's
    # each token's logprob and this many alternatives (legacy form; echo: the prompt's too)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: Text | None = None
    best_of: int | None = None
    logit_bias: dict[str, Any] | None = None
    presence_penalty: float | None = Field(None, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, allow_inf_nan=False)

    @field_validator("suffix", "best_of", "logit_bias", "presence_penalty", "frequency_penalty")
    @classmethod
    def _no_op_only(cls, value, info):
        if value is None or value in NO_OP_VALUES[info.field_name]:
            return value
        raise ValueError("not supported by this server (it would be ignored); leave it out")

    @field_validator("prompt")
    @classmethod
    def _prompts_not_empty(cls, prompt):
        prompts = [prompt] if isinstance(prompt, str) or _is_ids(prompt) else prompt
        if not prompts:
            raise ValueError("must not be empty: give text, token ids or a list of them")
        check_count(prompts, MAX_PROMPTS, "prompts per request")
        for index, one in enumerate(prompts):
            if len(one) == 0:
                which = "must not be empty" if prompts[0] is prompt else f"prompt {index} is empty"
                raise ValueError(f"{which}: a completion continues at least one token")
        return prompt

    @model_validator(mode="after")
    def _consistent(self) -> CompletionRequest:
        if self.max_tokens == 0:
            scoring = " (echo with max_tokens 0, the prompt scored alone, is not supported: " \
                      "ask max_tokens 1 and drop the last token)" if self.echo else ""
            raise ValueError(f"max_tokens: must be at least 1, got 0{scoring}")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.stream and len(self.prompts()) > 1:
            raise ValueError(f"prompt: a list of {len(self.prompts())} prompts is not streamed "
                             f"here: send stream false, or one prompt per request")
        return self

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: text or token ids."""
        if isinstance(self.prompt, str) or _is_ids(self.prompt):
            return [self.prompt]
        return list(self.prompt)


    def text_constraint(self) -> AskedConstraint | None:
        """What the continuation follows: our `structured_outputs`."""
        return one_constraint(
            structured_outputs=self.structured_outputs and self.structured_outputs.constraint())


def _is_ids(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], int)
