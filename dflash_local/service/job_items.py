"""What crosses between an API edge and the generation worker: the request a job carries
(`JobRequest`) and the items its queue delivers (`Started`, `Chunk`, `Finished`, `Failed`)."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_local.events import GenerationParams, GenerationStats, StepEvent
from dflash_local.service.raw_prompt import PromptEcho, RawPrompt


@dataclass(frozen=True)
class JobRequest:
    """What every API edge (chat completions, messages, responses) asks the worker for.

    `messages` are chat-template messages as Hugging Face templates take them: an assistant's
    calls under "tool_calls" ([{"id", "type": "function", "function": {"name", "arguments": dict}}]),
    a result as {"role": "tool", "tool_call_id", "content"}. `tools` are OpenAI function tools
    ({"type": "function", "function": {"name", "description", "parameters"}}); `tool_choice` is
    "auto", "none", "required" or {"type": "function", "function": {"name": ...}}."""

    messages: list[dict]
    params: GenerationParams
    # False: params.max_tokens is a default. Either way a max_tokens past the room the prompt
    # leaves is lowered to it (a given one, logged), as llama.cpp, Ollama and LM Studio do:
    # agents ask for more than a small local context holds, and loop on a refusal
    max_tokens_given: bool
    thinking: bool | None = None
    stop: tuple[str, ...] = ()
    tools: tuple[dict, ...] = ()
    tool_choice: str | dict = "auto"
    # legacy completions: the prompt's ids as given, in place of templated `messages`
    raw_prompt: RawPrompt | None = None
    # False: the reply stays out of the replies recorded for the drafter (chat's `store: false`)
    record: bool = True


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of one tool call the model wrote, as OpenAI streams it: a call's first piece
    carries its id and name, the next ones more of its arguments' JSON text."""

    index: int  # which call of this reply, from 0
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class Chunk:
    text: str  # the text delta, stop strings applied (tool-call markup taken out)
    event: StepEvent
    finish_reason: str | None  # "stop", "length" or "tool_calls" on the last chunk
    tool_calls: tuple[ToolCallDelta, ...] = ()
    stop_sequence: str | None = None  # the request's stop string that ended the reply, if one did
    logprobs: tuple[dict, ...] = ()  # OpenAI's logprobs.content entries of this chunk's text
    reasoning: str = ""  # the reasoning delta (a harmony target's analysis channel)
    echo: PromptEcho | None = None  # a completion's prompt, on its first chunk when asked


@dataclass(frozen=True)
class Started:
    """A local engine's prompt passed every check; its prefill begins (it may take a while)."""

    prompt_tokens: int


@dataclass(frozen=True)
class Finished:
    stats: GenerationStats


@dataclass(frozen=True)
class Failed:
    error: Exception
