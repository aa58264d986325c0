"""POST /v1/chat/completions: the request as a job, the reply in OpenAI's chat shapes.

The job plumbing (submit, first item, disconnect, SSE loop, usage) is jobs.py's, shared with
/v1/messages and /v1/responses; here are only what chat asks and how its reply looks.
"""

from __future__ import annotations

from fastapi import Request

from dflash_local.errors import InvalidRequestError
from dflash_local.service import jobs, responses
from dflash_local.service.api_errors import error_body
from dflash_local.service.schemas import ChatCompletionRequest
from dflash_local.service.state import LoadedPair
from dflash_local.service.worker import Chunk, JobRequest


def job_request(body: ChatCompletionRequest, loaded: LoadedPair) -> JobRequest:
    if body.logprobs and not loaded.engine.capabilities.logprobs:
        raise InvalidRequestError("logprobs: true is not supported by this engine: a served "
                                  "engine relays the server's text, not its log-probabilities")
    max_tokens = body.requested_max_tokens()
    params = jobs.generation_params(body, loaded, max_tokens, body.temperature, body.top_p,
                                    seed=body.seed, logprobs=body.requested_logprobs())
    return JobRequest(messages=[m.as_template_message() for m in body.messages], params=params,
                      max_tokens_given=max_tokens is not None, thinking=body.thinking_mode(),
                      stop=body.stop_strings(),
                      tools=tuple(tool.as_template_tool() for tool in body.tools or ()),
                      tool_choice=body.tool_choice_value())


class ChatEncoder:
    """chat.completion.chunk events ending in `[DONE]`, or one chat.completion body."""

    def __init__(self, reply_id: str, model: str, include_usage: bool, logprobs: bool):
        self.writer = responses.ChunkWriter(reply_id, model)
        self.reply_id = reply_id
        self.model = model
        self.include_usage = include_usage
        self.logprobs = logprobs  # asked for: each chunk carries its text's entries

    def chunk(self, chunk: Chunk) -> bytes:
        logprobs = list(chunk.logprobs) if self.logprobs else None
        return responses.sse(self.writer.step(chunk.text, chunk.event, chunk.finish_reason,
                                              logprobs, chunk.tool_calls, chunk.reasoning))

    def finished(self, usage: dict) -> bytes:
        events = responses.sse(self.writer.usage(usage)) if self.include_usage else b""
        return events + responses.sse("[DONE]")

    def failed(self, status: int, message: str, code: str | None) -> bytes:
        # an error event, as OpenAI's SDK expects
        return responses.sse(error_body(status, message, code)) + responses.sse("[DONE]")

    def body(self, reply: jobs.Reply, usage: dict) -> dict:
        return responses.completion(self.reply_id, self.model, reply.text, reply.finish_reason, usage,
                                    reply.logprobs if self.logprobs else None,
                                    tuple(reply.tool_deltas), reply.reasoning)


async def complete(body: ChatCompletionRequest, loaded: LoadedPair, request: Request):
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    job = job_request(body, loaded)
    logprobs = job.params.logprobs is not None
    return await jobs.run(job, loaded, request,
                          lambda reply_id: ChatEncoder(reply_id, loaded.served_name, include_usage, logprobs),
                          body.stream)
