"""One request's job on the worker, whatever API asked for it: the plumbing every endpoint shares.

An endpoint builds a JobRequest and a ReplyEncoder (its API's shapes); `run` submits the job,
waits for its first item (errors before the first token stay proper HTTP statuses), watches for
a disconnect, then streams the encoder's SSE events or collects one reply and lets the encoder
shape its body. A client that leaves stops its job: the watcher sees the disconnect while we
wait, the SSE generator's `finally` once streaming.
A stream whose prefill outlasts KEEPALIVE_S (a 30k-token agent prompt) begins before its first
token, once the worker says the prompt passed its checks (Started), and sends a keep-alive after
every KEEPALIVE_S of silence: one mechanism for every API, each naming its keep-alive bytes.
An SSE comment says how the prefill goes (`: keep-alive prefill 30000 tokens, 12 s`), as
/dflash/status's `worker.current` does (its phase and prompt tokens).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from dflash_local.errors import DFlashError, InvalidRequestError
from dflash_local.events import (
    Auto,
    EngineCapabilities,
    GenerationParams,
    OutputConstraint,
    parse_block_size,
    widest_block,
)
from dflash_local.service.api_errors import status_of
from dflash_local.service.job_items import (
    Chunk,
    Failed,
    Finished,
    JobRequest,
    Started,
    ToolCallDelta,
)
from dflash_local.service.raw_prompt import PromptEcho
from dflash_local.service.sse import KEEPALIVE_S, SSE_HEADERS, keepalive_comment
from dflash_local.service.state import LoadedPair
from dflash_local.service.usage import reply_usage
from dflash_local.service.worker import Job

DEFAULT_MAX_TOKENS = 512
CLIENT_CLOSED = 499  # nginx's status for "the client closed the request"; nobody reads it


class ClientDisconnected(Exception):
    pass


@dataclass
class Reply:
    """A whole reply, gathered from its chunks (a non-streamed request)."""

    text_parts: list[str] = field(default_factory=list)  # joined once: a reply may be long
    reasoning_parts: list[str] = field(default_factory=list)  # a harmony target's analysis
    tool_deltas: list[ToolCallDelta] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)  # chat's logprobs.content entries
    finish_reason: str | None = None
    stop_sequence: str | None = None
    echo: PromptEcho | None = None  # a completion's prompt, when it asked for it back

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def reasoning(self) -> str:
        return "".join(self.reasoning_parts)

    def add(self, chunk: Chunk) -> None:
        self.text_parts.append(chunk.text)
        self.reasoning_parts.append(chunk.reasoning)
        self.tool_deltas += chunk.tool_calls
        self.logprobs += chunk.logprobs
        self.finish_reason = chunk.finish_reason or self.finish_reason
        self.stop_sequence = chunk.stop_sequence or self.stop_sequence
        self.echo = chunk.echo or self.echo

    def tool_calls(self) -> list[dict]:
        """OpenAI's whole calls: {"id", "type", "function": {"name", "arguments": JSON text}}."""
        return whole_tool_calls(tuple(self.tool_deltas))


def whole_tool_calls(pieces: tuple[ToolCallDelta, ...]) -> list[dict]:
    """A reply's streamed pieces joined into OpenAI's `message.tool_calls`."""
    calls: dict[int, dict] = {}
    for piece in pieces:
        call = calls.setdefault(piece.index, {"id": None, "type": "function",
                                              "function": {"name": None, "arguments": ""}})
        call["id"] = piece.id or call["id"]
        call["function"]["name"] = piece.name or call["function"]["name"]
        call["function"]["arguments"] += piece.arguments
    return [calls[index] for index in sorted(calls)]


def shows_text(text: str, tool_calls: list) -> bool:
    """Whether a whole reply's text is worth a block of its own: beside calls, only if not
    blank (as chat's `content` is null then)."""
    return bool(text) and (bool(text.strip()) or not tool_calls)


class ReplyEncoder(Protocol):
    """An API's shapes for one reply: SSE events per outbox item, or one JSON body."""

    def chunk(self, chunk: Chunk) -> bytes: ...

    def finished(self, usage: dict) -> bytes: ...  # the stream's last events

    def failed(self, status: int, message: str, code: str | None) -> bytes: ...

    def body(self, reply: Reply, usage: dict) -> dict: ...


def check_capabilities(options, temperature: float | None, capabilities: EngineCapabilities) -> None:
    """Refuse what the engine declares it cannot do, rather than silently ignoring it.
    `options` holds our extensions (request_fields.DFlashOptions)."""
    if options.speculative is not None and not capabilities.speculative_toggle:
        raise InvalidRequestError("this engine cannot switch speculation per request")
    if options.block_size is not None and not capabilities.block_size_per_request:
        raise InvalidRequestError("this engine cannot change the block size per request")
    for name in ("prompt_lookup", "tree", "draft_window"):
        if getattr(options, name) is not None and not capabilities.block_size_per_request:
            raise InvalidRequestError(f"this engine runs its own speculation: {name} cannot be set per request")
    if temperature and not capabilities.sampling:
        raise InvalidRequestError("this engine decodes greedily only: temperature must be 0")


def generation_params(options, loaded: LoadedPair, max_tokens: int | None,
                      temperature: float | None, top_p: float | None, seed: int | None = None,
                      top_k: int | None = None, logprobs: int | None = None,
                      constraint: OutputConstraint | None = None) -> GenerationParams:
    """The sampling fields an API names its own way, plus our extensions, as the loop's params;
    `constraint`: what the reply must follow (reply_constraint.py)."""
    check_capabilities(options, temperature, loaded.engine.capabilities)
    speculative = options.speculative
    if speculative is None:
        speculative = loaded.engine.pair.drafter is not None
    return GenerationParams(
        max_tokens=max_tokens or DEFAULT_MAX_TOKENS,
        temperature=temperature if temperature is not None else 0.0,
        top_p=top_p if top_p is not None else 1.0,
        top_k=top_k or 0,
        seed=seed, speculative=speculative,
        block_size=(parse_block_size(options.block_size) if options.block_size is not None
                    else loaded.default_block_size),
        prompt_lookup=options.prompt_lookup is not False,
        tree=options.tree is not False,
        draft_window=options.draft_window,
        logprobs=logprobs,
        constraint=constraint,
    )


async def run(request: JobRequest, loaded: LoadedPair, http_request: Request,
              make_encoder: Callable[[str], ReplyEncoder], stream: bool,
              id_prefix: str | None = None, keepalive: bytes | None = None) -> Response:
    """`make_encoder(reply_id)`; `id_prefix` names the reply as its API does ("msg_", "resp_");
    `keepalive`: the SSE bytes a stream sends while nothing else comes (None: an SSE comment
    that says how the prefill goes)."""
    try:
        if not stream:
            return JSONResponse(await reply_body(request, loaded, http_request, make_encoder,
                                                 id_prefix))
        job, encoder = await _submitted(request, loaded, make_encoder, id_prefix)
        watcher = asyncio.create_task(_wait_disconnect(http_request))
        try:
            first = await _next(job, watcher)
            if isinstance(first, Started):  # None after KEEPALIVE_S: the prefill goes on, streamed
                first = await _next(job, watcher, timeout=KEEPALIVE_S)
            if isinstance(first, Failed):
                raise first.error
            return StreamingResponse(_stream(job, first, encoder, loaded, keepalive),
                                     headers=SSE_HEADERS, media_type="text/event-stream")
        finally:
            watcher.cancel()  # Starlette watches for the disconnect from here on
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)


async def reply_body(request: JobRequest, loaded: LoadedPair, http_request: Request,
                     make_encoder: Callable[[str], ReplyEncoder], id_prefix: str | None = None) -> dict:
    """A whole reply's body, not streamed (as `run`); ClientDisconnected if the client leaves."""
    job, encoder = await _submitted(request, loaded, make_encoder, id_prefix)
    watcher = asyncio.create_task(_wait_disconnect(http_request))
    try:
        item = await _next(job, watcher)
        if isinstance(item, Started):
            item = await _next(job, watcher)
        reply = Reply()
        while not isinstance(item, Finished):
            if isinstance(item, Failed):
                raise item.error
            reply.add(item)
            item = await _next(job, watcher)
        return encoder.body(reply, usage(item, job, loaded))
    finally:
        watcher.cancel()
        job.cancel()


async def _submitted(request: JobRequest, loaded: LoadedPair,
                     make_encoder: Callable[[str], ReplyEncoder],
                     id_prefix: str | None) -> tuple[Job, ReplyEncoder]:
    job = Job(request, asyncio.get_running_loop())
    if id_prefix is not None:
        job.id = id_prefix + job.id.removeprefix("chatcmpl-")
    encoder = make_encoder(job.id)
    # off the event loop, and before the worker: a body that cannot fit never holds it; with
    # the counter's own tokenizer (prompt_count.py), never the one the worker encodes with
    # (a completion's prompt is checked as ids, by openai_completions.raw_prompt)
    if loaded.prompt_counter is not None and request.raw_prompt is None:
        prompt_tools = [] if request.tool_choice == "none" else list(request.tools)  # as plan_tools does
        await asyncio.to_thread(loaded.prompt_counter.check_size, request.messages, prompt_tools)
    loaded.worker.submit(job)
    return job, encoder


async def _stream(job: Job, first, encoder: ReplyEncoder, loaded: LoadedPair,
                  keepalive: bytes | None) -> AsyncIterator[bytes]:
    items = [] if first is None else [first]
    try:
        while True:
            if not items:
                items = await _waiting_items(job)
                if not items:
                    yield keepalive or keepalive_comment(job.prefill_progress())
                    continue
            # every step stays its own SSE event; the steps already waiting go out in one write
            events, done = [], False
            for item in items:
                data, done = _encode(item, job, encoder, loaded)
                events.append(data)
                if done:
                    break
            yield b"".join(events)
            if done:
                return
            items = []
    finally:
        job.cancel()  # a no-op once finished; on disconnect it stops the worker within a round


async def _waiting_items(job: Job) -> list:
    """The job's next item and those behind it; [] after KEEPALIVE_S without one. Only an
    empty queue is waited on, under a deadline (no task per chunk, as wait_for would make)."""
    items = []
    if job.outbox.empty():
        try:
            async with asyncio.timeout(KEEPALIVE_S):
                items.append(await job.outbox.get())  # a cancelled get leaves its item queued
        except TimeoutError:
            return []
    while not job.outbox.empty():
        items.append(job.outbox.get_nowait())
    return items


def _encode(item, job: Job, encoder: ReplyEncoder, loaded: LoadedPair) -> tuple[bytes, bool]:
    """One outbox item as SSE bytes, and whether the stream ends with it."""
    if isinstance(item, Chunk):
        return encoder.chunk(item), False
    if isinstance(item, Finished):
        return encoder.finished(usage(item, job, loaded)), True
    error = item.error  # Failed after the stream began: the API's error event
    status = status_of(error) if isinstance(error, DFlashError) else 500
    message = str(error) if status != 500 else "internal server error"
    return encoder.failed(status, message, getattr(error, "code", None)), True


def usage(finished: Finished, job: Job, loaded: LoadedPair) -> dict:
    """Chat's usage (OpenAI's token counts and our `dflash` totals); other APIs rename from it."""
    params = job.request.params
    return reply_usage(finished.stats, loaded.engine.pair.engine,
                       widest_block(params, loaded.engine.pair.drafter_block), params.speculative,
                       auto=isinstance(params.block_size, Auto) and params.speculative)


async def _next(job: Job, watcher: asyncio.Task, timeout: float | None = None):
    """The job's next item (None after `timeout` seconds without one), or cancel the job if the
    client disconnects first. A cancelled get leaves its item in the queue."""
    getter = asyncio.ensure_future(job.outbox.get())
    done, _ = await asyncio.wait({getter, watcher}, timeout=timeout,
                                 return_when=asyncio.FIRST_COMPLETED)
    if getter in done:
        return getter.result()
    getter.cancel()
    if watcher not in done:
        return None
    job.cancel()
    raise ClientDisconnected(job.id)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
