"""One chat completion: request -> job on the worker -> SSE stream or one JSON body.

Errors found before the first token (queue full, prompt too long) become proper HTTP statuses:
the response starts only once the job's first item is in. A client that leaves stops its job:
the watcher sees the disconnect while we wait, the SSE generator's `finally` once streaming.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from dflash_local.errors import DFlashError, InvalidRequestError
from dflash_local.events import (
    Auto,
    EngineCapabilities,
    GenerationParams,
    parse_block_size,
    widest_block,
)
from dflash_local.service import responses
from dflash_local.service.errors import error_body, status_of
from dflash_local.service.schemas import ChatCompletionRequest
from dflash_local.service.state import LoadedPair
from dflash_local.service.worker import Chunk, Failed, Finished, Job, JobRequest

DEFAULT_MAX_TOKENS = 512
CLIENT_CLOSED = 499  # nginx's status for "the client closed the request"; nobody reads it
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientDisconnected(Exception):
    pass


def job_request(body: ChatCompletionRequest, loaded: LoadedPair) -> JobRequest:
    check_capabilities(body, loaded.engine.capabilities)
    max_tokens = body.requested_max_tokens()
    speculative = body.speculative
    if speculative is None:
        speculative = loaded.engine.pair.drafter is not None
    params = GenerationParams(
        max_tokens=max_tokens or DEFAULT_MAX_TOKENS,
        temperature=body.temperature if body.temperature is not None else 0.0,
        top_p=body.top_p if body.top_p is not None else 1.0,
        seed=body.seed, speculative=speculative,
        block_size=(parse_block_size(body.block_size) if body.block_size is not None
                    else loaded.default_block_size),
        prompt_lookup=body.prompt_lookup is not False,
        tree=body.tree is not False,
        draft_window=body.draft_window,
        logprobs=body.requested_logprobs(),
    )
    return JobRequest(messages=[m.as_template_message() for m in body.messages], params=params,
                      max_tokens_given=max_tokens is not None, thinking=body.thinking_mode(),
                      stop=body.stop_strings(),
                      tools=tuple(tool.as_template_tool() for tool in body.tools or ()),
                      tool_choice=body.tool_choice_value())


def check_capabilities(body: ChatCompletionRequest, capabilities: EngineCapabilities) -> None:
    """Refuse what the engine declares it cannot do, rather than silently ignoring it."""
    if body.speculative is not None and not capabilities.speculative_toggle:
        raise InvalidRequestError("this engine cannot switch speculation per request")
    if body.block_size is not None and not capabilities.block_size_per_request:
        raise InvalidRequestError("this engine cannot change the block size per request")
    for name in ("prompt_lookup", "tree", "draft_window"):
        if getattr(body, name) is not None and not capabilities.block_size_per_request:
            raise InvalidRequestError(f"this engine runs its own speculation: {name} cannot be set per request")
    if body.logprobs and not capabilities.logprobs:
        raise InvalidRequestError("logprobs: true is not supported by this engine: a served "
                                  "engine relays the server's text, not its log-probabilities")
    if body.temperature and not capabilities.sampling:
        raise InvalidRequestError("this engine decodes greedily only: temperature must be 0")


async def complete(body: ChatCompletionRequest, loaded: LoadedPair, request: Request):
    job = Job(job_request(body, loaded), asyncio.get_running_loop())
    loaded.worker.submit(job)
    watcher = asyncio.create_task(_wait_disconnect(request))
    try:
        first = await _next(job, watcher)
        if isinstance(first, Failed):
            raise first.error
        if body.stream:
            return StreamingResponse(_stream(job, first, body, loaded), headers=SSE_HEADERS,
                                     media_type="text/event-stream")
        return await _collect(job, first, loaded, watcher)
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)
    finally:
        watcher.cancel()  # streaming: Starlette watches for the disconnect from here on
        if not body.stream:
            job.cancel()


async def _collect(job: Job, item, loaded: LoadedPair, watcher: asyncio.Task) -> JSONResponse:
    parts, reasoning, logprobs, calls = [], [], [], []
    finish = None
    while not isinstance(item, Finished):
        if isinstance(item, Failed):
            raise item.error
        parts.append(item.text)
        reasoning.append(item.reasoning)
        logprobs += item.logprobs
        calls += item.tool_calls
        finish = item.finish_reason or finish
        item = await _next(job, watcher)
    usage = _usage(item, job, loaded)
    asked = job.request.params.logprobs is not None
    return JSONResponse(responses.completion(job.id, loaded.served_name, "".join(parts), finish,
                                             usage, logprobs if asked else None, tuple(calls),
                                             "".join(reasoning)))


async def _stream(job: Job, first, body: ChatCompletionRequest,
                  loaded: LoadedPair) -> AsyncIterator[bytes]:
    writer = responses.ChunkWriter(job.id, loaded.served_name)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    items = [first]
    try:
        while True:
            # every step stays its own SSE event; the steps already waiting go out in one write
            events, done = [], False
            for item in items:
                data, done = _encode(item, job, loaded, writer, include_usage)
                events.append(data)
                if done:
                    break
            yield b"".join(events)
            if done:
                return
            items = [await job.outbox.get()]
            while not job.outbox.empty():
                items.append(job.outbox.get_nowait())
    finally:
        job.cancel()  # a no-op once finished; on disconnect it stops the worker within a round


def _encode(item, job: Job, loaded: LoadedPair, writer: responses.ChunkWriter,
            include_usage: bool) -> tuple[bytes, bool]:
    """One outbox item as SSE bytes, and whether the stream ends with it."""
    if isinstance(item, Chunk):
        logprobs = list(item.logprobs) if job.request.params.logprobs is not None else None
        step = writer.step(item.text, item.event, item.finish_reason, logprobs, item.tool_calls,
                           item.reasoning)
        return responses.sse(step), False
    if isinstance(item, Finished):
        usage = responses.sse(writer.usage(_usage(item, job, loaded))) if include_usage else b""
        return usage + responses.sse("[DONE]"), True
    # Failed after the stream began: an error event, as OpenAI's SDK expects
    error = item.error
    status = status_of(error) if isinstance(error, DFlashError) else 500
    message = str(error) if status != 500 else "internal server error"
    return responses.sse(error_body(status, message, getattr(error, "code", None))) + \
        responses.sse("[DONE]"), True


def _usage(finished: Finished, job: Job, loaded: LoadedPair) -> dict:
    params = job.request.params
    return responses.usage(finished.stats, loaded.engine.pair.engine,
                           widest_block(params, loaded.engine.pair.block_size), params.speculative,
                           auto=isinstance(params.block_size, Auto) and params.speculative)


async def _next(job: Job, watcher: asyncio.Task):
    """The job's next item, or cancel it if the client disconnects first."""
    getter = asyncio.ensure_future(job.outbox.get())
    done, _ = await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if getter in done:
        return getter.result()
    getter.cancel()
    job.cancel()
    raise ClientDisconnected(job.id)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
