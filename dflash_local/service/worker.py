"""The generation worker: one thread per loaded engine runs one generation at a time.

Jobs wait in a bounded queue (full -> QueueFullError, a 429). The thread hands each round's
output to the job's asyncio queue through `call_soon_threadsafe`, so the event loop never waits
on the engine. A job's cancel flag is checked after every round; the engine's iterator is then
closed, so a disconnected client costs at most the round already running.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from dflash_local.engines.interface import Engine
from dflash_local.errors import DFlashError, GenerationCancelled, PromptTooLongError
from dflash_local.events import GenerationParams, GenerationStats, StepEvent
from dflash_local.service.api_errors import NoModelLoadedError, QueueFullError
from dflash_local.service.harmony import HarmonySplitter
from dflash_local.service.logprob_entries import LogprobEntries
from dflash_local.service.raw_prompt import PromptEcho, RawPrompt, prompt_echo
from dflash_local.service.stop_strings import StopMatcher
from dflash_local.service.tool_calls import ToolPlan, ToolSupport, new_call_id, plan_tools
from dflash_local.service.tool_stream import ToolCallSplitter

log = logging.getLogger("dflash_local.service")


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


class Job:
    """One request's generation; `outbox` is read on the event loop, written from the worker."""

    def __init__(self, request: JobRequest, loop: asyncio.AbstractEventLoop):
        self.id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        self.request = request
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.outcome = "queued"  # queued | running | finished | cancelled | failed
        self.rounds = 0  # speculative rounds run (the prefill is not a round)
        self.rounds_at_cancel: int | None = None
        self.prompt_ids: list[int] | None = None  # a local engine's, once templated
        self.echo: PromptEcho | None = None  # a completion's echoed prompt, until sent
        self.prefill_started: float | None = None  # monotonic, once the prompt passed its checks
        # the text the client got (stop strings applied), a piece per round: joined once, when
        # the next turn is warmed (appending to one string copies the whole reply every round)
        self.reply_parts: list[str] = []
        self._loop = loop
        self._cancel = threading.Event()
        self._handoff: deque = deque()  # items put by the worker, not yet in outbox
        self._handoff_lock = threading.Lock()
        self._delivery_scheduled = False

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def cancel(self) -> None:
        if self._cancel.is_set() or self.outcome in ("finished", "failed"):
            return
        self.rounds_at_cancel = self.rounds
        self._cancel.set()

    def put(self, item: Started | Chunk | Finished | Failed) -> None:
        """From the worker thread. The loop is woken once per batch, not once per item: when it
        falls behind, the items that pile up are delivered (and written) together."""
        with self._handoff_lock:
            self._handoff.append(item)
            if self._delivery_scheduled:
                return
            self._delivery_scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed: the server is shutting down
            self._cancel.set()

    def _deliver(self) -> None:
        with self._handoff_lock:
            items = list(self._handoff)
            self._handoff.clear()
            self._delivery_scheduled = False
        for item in items:
            self.outbox.put_nowait(item)

    @property
    def phase(self) -> str:
        """queued, prefill (its prompt's rows going into the cache: no token yet), or decode."""
        if self.prefill_started is None:
            return "queued" if self.outcome == "queued" else "decode"
        return "prefill" if not self.reply_parts else "decode"

    def prefill_progress(self) -> str:
        """What a keep-alive says while the prefill runs: the prompt's size and the time so far
        (the prefill is one pass per chunk, with no count of its own to report)."""
        if self.phase != "prefill" or self.prompt_ids is None:
            return ""
        elapsed = time.monotonic() - self.prefill_started
        return f"prefill {len(self.prompt_ids)} tokens, {elapsed:.0f} s"

    def summary(self) -> dict:
        return {"id": self.id, "outcome": self.outcome, "phase": self.phase,
                "prompt_tokens": None if self.prompt_ids is None else len(self.prompt_ids),
                "rounds": self.rounds, "rounds_at_cancel": self.rounds_at_cancel}


def split_calls(splitter: ToolCallSplitter | HarmonySplitter, text: str, finish: str | None
                ) -> tuple[str, str, tuple[ToolCallDelta, ...], str | None]:
    """A step's text without call markup, its reasoning (harmony's analysis), the calls it
    completed as OpenAI streams each (its id and name, then its arguments), and the finish
    reason ("tool_calls" for a reply that called)."""
    first_index = splitter.calls_made
    text, calls = splitter.feed(text)
    if finish:
        more, last = splitter.finish()
        text, calls = text + more, calls + last
    if finish == "stop" and splitter.calls_made:
        finish = "tool_calls"
    deltas = []
    for index, call in enumerate(calls, start=first_index):
        deltas += [ToolCallDelta(index, new_call_id(), call.name), ToolCallDelta(index, arguments=call.arguments)]
    return text, splitter.take_reasoning(), tuple(deltas), finish


def encode_prompt(engine: Engine, request: JobRequest, tools: ToolPlan) -> list[int]:
    """A local engine's prompt for the request: its template, with the tools and a forced call's
    opener of `tools` (plan_tools). Generation and count_tokens both encode through here."""
    return engine.encode_chat(request.messages, thinking=request.thinking, tools=tools.tools,
                              assistant_prefix=tools.assistant_prefix)


class GenerationWorker:
    def __init__(self, engine: Engine, max_queue: int = 8):
        self.engine = engine
        self.max_queue = max_queue
        self.current: Job | None = None
        self.last: Job | None = None
        self.jobs_done = 0
        self.rounds_total = 0
        self.tool_support = ToolSupport.of(engine)  # the template's tool format, read once
        self.warmed = 0  # conversations whose next turn was warmed (turn_warmup.py)
        self.warm_ups_ended = 0  # warm-ups ended: stored, cut by a job, or nothing to do
        self._closed = False
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._serve, name="generation-worker", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        if self._closed:
            raise NoModelLoadedError("the model is being unloaded")
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFullError(f"the generation queue is full ({self.max_queue} requests "
                                 f"waiting); retry later") from None

    @property
    def busy(self) -> bool:
        return self.current is not None or not self._queue.empty()

    def status(self) -> dict:
        current = self.current
        return {"busy": self.busy, "queued": self._queue.qsize(), "max_queue": self.max_queue,
                "current": current.summary() if current else None,
                "last": self.last.summary() if self.last else None,
                "jobs_done": self.jobs_done, "rounds_total": self.rounds_total,
                "warmed": self.warmed}

    def retire(self, on_idle: Callable[[], None]) -> None:
        """Refuse new jobs, finish the ones already taken, then call `on_idle` (free the engine):
        a pair replaced by a load ends its clients' replies instead of cutting them."""
        self._closed = True

        def drain() -> None:
            self._queue.put(None)  # behind the queued jobs; waits for room in a full queue
            self._thread.join()
            on_idle()

        threading.Thread(target=drain, name="generation-worker-retire", daemon=True).start()

    def close(self, timeout: float = 30.0) -> None:
        """Refuse new jobs, fail the queued ones, cancel the running one, stop the thread."""
        self._closed = True
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.outcome = "failed"
                job.put(Failed(NoModelLoadedError("the model was unloaded")))
        if self.current is not None:
            self.current.cancel()
        self._queue.put(None)
        self._thread.join(timeout)

    def _serve(self) -> None:
        while (job := self._queue.get()) is not None:
            if job.cancelled:  # its client left while it waited
                job.outcome = "cancelled"
                continue
            self.current = job
            try:
                self._run(job)
            finally:
                self.current = None
                self.last = job
                self.jobs_done += 1
            self._warm_next_turn(job)

    def _warm_next_turn(self, job: Job) -> None:
        """While no job waits, ready the prefix cache for this conversation's next request
        (engines/turn_warmup.py); a job that arrives stops it within a chunk of rows."""
        request = job.request
        if (job.outcome != "finished" or job.prompt_ids is None or request.tools
                or request.raw_prompt is not None):
            # a reply with tool calls is written back otherwise than its text; a completion
            # has no next turn
            return
        try:
            if self.engine.warm_next_turn(request.messages, "".join(job.reply_parts),
                                          job.prompt_ids,
                                          request.params, request.thinking,
                                          lambda: self._closed or not self._queue.empty()):
                self.warmed += 1
        except Exception:  # the worker's edge: a failed warm-up costs the next turn time only
            log.exception("warming the prefix cache after %s failed", job.id)
        finally:
            self.warm_ups_ended += 1

    def _run(self, job: Job) -> None:
        job.outcome = "running"
        try:
            stats = self._generate(job)
        except DFlashError as exc:
            job.outcome = "failed"
            job.put(Failed(exc))
            return
        except Exception as exc:  # the worker's edge: log it, tell the client, go on
            log.exception("generation %s failed", job.id)
            job.outcome = "failed"
            job.put(Failed(exc))
            return
        if stats is None:
            job.outcome = "cancelled"
            job.put(Failed(GenerationCancelled("the generation was cancelled")))
        else:
            job.outcome = "finished"
            job.put(Finished(self._with_server_totals(stats)))

    def _generate(self, job: Job) -> GenerationStats | None:
        request = job.request
        stats = GenerationStats()
        stops = StopMatcher(request.stop)
        # only local engines declare logprobs (chat.job_request refuses the others): they have a tokenizer
        logprobs = (LogprobEntries(self.engine.tokenizer, completions=request.raw_prompt is not None)
                    if request.params.logprobs is not None else None)
        tools = plan_tools(self.tool_support, request.tools, request.tool_choice)
        stream = self._open_stream(job, tools, logprobs)
        try:
            for event in stream:
                stats.add(event)
                if event.round_index > 0:
                    job.rounds += 1
                    self.rounds_total += 1
                text, hit_stop = stops.feed(event.text)
                finish = "stop" if hit_stop else event.finish_reason
                if finish and not hit_stop:
                    text += stops.flush()
                # a tool call's tokens keep their entries: they are generated tokens
                entries = () if logprobs is None else logprobs.take(event, text, finish, hit_stop)
                deltas: tuple[ToolCallDelta, ...] = ()
                reasoning = ""
                if tools.splitter is not None:  # stops first: a stop inside a call leaves it unclosed
                    text, reasoning, deltas, finish = split_calls(tools.splitter, text, finish)
                job.reply_parts.append(text)
                job.put(Chunk(text, event, finish, deltas, logprobs=tuple(entries),
                              stop_sequence=stops.matched if hit_stop and finish == "stop" else None,
                              reasoning=reasoning, echo=job.echo))
                job.echo = None
                if finish:
                    stats.finish_reason = finish
                    return stats
                if job.cancelled:
                    return None
        finally:
            stream.close()  # stops the engine's loop; its per-generation state is dropped
        return stats

    def _with_server_totals(self, stats: GenerationStats) -> GenerationStats:
        """A served engine learns the prompt's length and its cache hits only from the server's
        final usage."""
        served = self.engine.last_stats
        if not self.engine.capabilities.tokenizes and served is not None:
            stats.prompt_tokens = stats.prompt_tokens or served.prompt_tokens
            stats.cached_tokens = stats.cached_tokens or served.cached_tokens
        return stats

    def _open_stream(self, job: Job, tools: ToolPlan, logprobs: LogprobEntries | None):
        request, raw = job.request, job.request.raw_prompt
        if not self.engine.capabilities.tokenizes:  # a served engine: its server templates and caps max_tokens
            return self.engine.stream_chat(request.messages, request.params, thinking=request.thinking)
        job.prompt_ids = list(raw.ids) if raw is not None else encode_prompt(self.engine, request, tools)
        params = self._fit_max_tokens(job, len(job.prompt_ids))
        job.prefill_started = time.monotonic()
        job.put(Started(len(job.prompt_ids)))  # the request holds: errors from here on are the stream's
        if raw is not None and raw.echo:  # scored first: the generation then resumes its state
            job.echo = prompt_echo(self.engine, raw, params, logprobs)
        return self.engine.stream(job.prompt_ids, params)

    def _fit_max_tokens(self, job: Job, prompt_len: int) -> GenerationParams:
        request, context = job.request, self.engine.capabilities.max_context
        room = context - prompt_len
        if room < 1:
            raise PromptTooLongError(f"prompt of {prompt_len} tokens fills the target's context "
                                     f"of {context} tokens", prompt_tokens=prompt_len,
                                     max_context=context)
        asked = request.params.max_tokens
        if asked <= room:
            return request.params
        if request.max_tokens_given:
            log.info("%s: max_tokens %d lowered to the %d tokens left (prompt %d, context %d)",
                     job.id, asked, room, prompt_len, context)
        return replace(request.params, max_tokens=room)
