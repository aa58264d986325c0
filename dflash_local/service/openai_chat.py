"""POST /v1/chat/completions: the request as a job, the reply in OpenAI's chat shapes
(chat.completion.chunk events ending in `[DONE]`, or one chat.completion body).

The job plumbing (submit, first item, disconnect, SSE loop, usage) is jobs.py's, shared with
/v1/messages and /v1/responses; here are only what chat asks and how its reply looks. As on every
API, any model name but another known pair's is the loaded pair, a max_tokens past the room the
prompt leaves is lowered to it, and a prompt that leaves none is refused in OpenAI's words.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request

from dflash_local.errors import InvalidRequestError, PromptTooLongError
from dflash_local.events import StepEvent
from dflash_local.service import jobs
from dflash_local.service.api_errors import error_body
from dflash_local.service.app_state import ServiceStateDep
from dflash_local.service.job_items import Chunk, JobRequest, ToolCallDelta
from dflash_local.service.openai_chat_schemas import ChatCompletionRequest
from dflash_local.service.reply_constraint import reply_constraint
from dflash_local.service.sse import sse
from dflash_local.service.state import LoadedPair
from dflash_local.service.usage import step_dflash

router = APIRouter()
CHAT_PATH = "/v1/chat/completions"


@router.post(CHAT_PATH)
async def chat_completions(body: ChatCompletionRequest, request: Request, state: ServiceStateDep):
    loaded = state.require_model(body.model)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    job = job_request(body, loaded)
    logprobs = job.params.logprobs is not None
    try:
        return await jobs.run(job, loaded, request,
                              lambda reply_id: ChatEncoder(reply_id, loaded.served_name, include_usage, logprobs),
                              body.stream)
    except PromptTooLongError as exc:
        raise chat_context_error(exc) from None


def chat_context_error(exc: PromptTooLongError) -> PromptTooLongError:
    """A prompt that leaves no room to reply (a max_tokens past the room is lowered to it), in
    OpenAI's words, which its clients' overflow checks match: litellm's
    ContextWindowExceededError, the agents' compaction."""
    prompt, context = exc.prompt_tokens, exc.max_context
    if prompt is not None and context is not None:
        message = (f"This model's maximum context length is {context} tokens. However, your "
                   f"messages resulted in {prompt} tokens. Please reduce the length of the messages.")
    else:
        message = (f"This model's maximum context length is exceeded: {exc}. Please reduce the "
                   f"length of the messages.")
    return PromptTooLongError(message, prompt, exc.max_tokens, context)


def job_request(body: ChatCompletionRequest, loaded: LoadedPair) -> JobRequest:
    if body.logprobs and not loaded.engine.capabilities.logprobs:
        raise InvalidRequestError("logprobs: true is not supported by this engine: a served "
                                  "engine relays the server's text, not its log-probabilities")
    max_tokens = body.requested_max_tokens()
    tools = tuple(tool.as_template_tool() for tool in body.tools or ())
    constraint, thinking = reply_constraint(
        loaded, body.text_constraint(), tools, body.tool_choice_value(), body.enforced_tools(),
        body.thinking_mode(), CHAT_PATH)
    params = jobs.generation_params(body, loaded, max_tokens, body.temperature, body.top_p,
                                    seed=body.seed, logprobs=body.requested_logprobs(),
                                    constraint=constraint)
    return JobRequest(messages=[m.as_template_message() for m in body.messages], params=params,
                      max_tokens_given=max_tokens is not None, thinking=thinking,
                      stop=body.stop_strings(), tools=tools, tool_choice=body.tool_choice_value(),
                      record=body.store is not False)


class ChatEncoder:
    """chat.completion.chunk events ending in `[DONE]`, or one chat.completion body."""

    def __init__(self, reply_id: str, model: str, include_usage: bool, logprobs: bool):
        self.writer = ChunkWriter(reply_id, model)
        self.reply_id = reply_id
        self.model = model
        self.include_usage = include_usage
        self.logprobs = logprobs  # asked for: each chunk carries its text's entries

    def chunk(self, chunk: Chunk) -> bytes:
        logprobs = list(chunk.logprobs) if self.logprobs else None
        return sse(self.writer.step(chunk.text, chunk.event, chunk.finish_reason, logprobs,
                                    chunk.tool_calls, chunk.reasoning))

    def finished(self, usage: dict) -> bytes:
        events = sse(self.writer.usage(usage)) if self.include_usage else b""
        return events + sse("[DONE]")

    def failed(self, status: int, message: str, code: str | None) -> bytes:
        # an error event, as OpenAI's SDK expects
        return sse(error_body(status, message, code)) + sse("[DONE]")

    def body(self, reply: jobs.Reply, usage: dict) -> dict:
        return completion(self.reply_id, self.model, reply.text, reply.finish_reason, usage,
                          reply.logprobs if self.logprobs else None,
                          tuple(reply.tool_deltas), reply.reasoning)


class ChunkWriter:
    """Builds the chat.completion.chunk payloads of one streamed response."""

    def __init__(self, job_id: str, model: str):
        self.job_id = job_id
        self.model = model
        self.created = int(time.time())
        self._sent_role = False

    def _base(self) -> dict:
        return {"id": self.job_id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model}

    def step(self, text: str, event: StepEvent, finish_reason: str | None,
             logprobs: list[dict] | None = None,
             tool_calls: tuple[ToolCallDelta, ...] = (), reasoning: str = "") -> dict:
        """`logprobs`: the entries of this chunk's text (service/logprob_entries.py), None unasked;
        `reasoning`: a harmony target's analysis text, as vLLM's `reasoning_content`."""
        delta = {"content": text if text or not (tool_calls or reasoning) else None}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if tool_calls:
            delta["tool_calls"] = [tool_call_delta(piece) for piece in tool_calls]
        if not self._sent_role:
            delta = {"role": "assistant", **delta}
            self._sent_role = True
        return {**self._base(), "choices": [{"index": 0, "delta": delta,
                                             "logprobs": logprobs_object(logprobs),
                                             "finish_reason": finish_reason}],
                "dflash": step_dflash(event)}

    def usage(self, usage_payload: dict) -> dict:
        return {**self._base(), "choices": [], "usage": usage_payload}


def tool_call_delta(piece: ToolCallDelta) -> dict:
    """OpenAI's streamed shape: a call's first piece has its id, type and name."""
    if piece.id is None:
        return {"index": piece.index, "function": {"arguments": piece.arguments}}
    return {"index": piece.index, "id": piece.id, "type": "function",
            "function": {"name": piece.name, "arguments": piece.arguments}}


def logprobs_object(entries: list[dict] | None) -> dict | None:
    return None if entries is None else {"content": entries, "refusal": None}


def completion(job_id: str, model: str, text: str, finish_reason: str | None,
               usage_payload: dict, logprobs: list[dict] | None = None,
               tool_calls: tuple[ToolCallDelta, ...] = (), reasoning: str = "") -> dict:
    message = {"role": "assistant", "content": text}
    if tool_calls:  # OpenAI: content null when the reply only calls
        message = {"role": "assistant", "content": text if text.strip() else None,
                   "tool_calls": jobs.whole_tool_calls(tool_calls)}
    if reasoning:  # a harmony target's analysis channel, named as vLLM and DeepSeek name it
        message["reasoning_content"] = reasoning
    return {"id": job_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message,
                         "logprobs": logprobs_object(logprobs), "finish_reason": finish_reason}],
            "usage": usage_payload}
