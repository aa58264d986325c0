"""The generation worker: one thread per loaded engine runs the generations in flight as
cooperative lanes (lanes.py: each round's verify batched with the others', prefills in chunks
between their rounds; scheduler.py: up to max_batch of them, the waiting jobs, admission).

Jobs past the free places wait in a bounded queue (full -> QueueFullError, a 429). The thread
hands each round's output to the job's asyncio queue through `call_soon_threadsafe`, so the
event loop never waits on the engine. A job's cancel flag is checked after every round and at
every prefill chunk; the engine's iterator is then closed, so a disconnected client costs at
most the round running.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Protocol

from dflash_local.engines.interface import Engine
from dflash_local.errors import DFlashError, GenerationCancelled, PromptTooLongError
from dflash_local.events import GenerationParams, GenerationStats, StepEvent
from dflash_local.service.api_errors import NoModelLoadedError
from dflash_local.service.heap import trim_heap
from dflash_local.service.job_items import (
    Chunk,
    Failed,
    Finished,
    JobRequest,
    Started,
    ToolCallDelta,
)
from dflash_local.service.lanes import Lane, Lanes
from dflash_local.service.logprob_entries import LogprobEntries
from dflash_local.service.raw_prompt import PromptEcho, prompt_echo
from dflash_local.service.scheduler import RoundRobin
from dflash_local.service.stop_strings import StopMatcher
from dflash_local.service.tool_calls import NO_TOOLS, ToolPlan, ToolSupport, plan_tools, split_calls

log = logging.getLogger("dflash_local.service")
IDLE_POLL_S = 1.0  # how often an idle worker looks for idle work no job woke it for (adapt reset)


class IdleWork(Protocol):
    """Work the worker runs in slices while idle (adapt/idle.py): `has_work` is asked before
    every slice (cheap); `run_slice` is one bounded piece (the longest a job arriving waits)."""

    def has_work(self) -> bool: ...

    def run_slice(self) -> None: ...


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
        self.reply_ids: list[int] = []  # every token the engine committed (adapt/record.py keeps them)
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
        """queued, prefill (its prompt's rows going into the cache, here or on a served
        engine's server: no token yet), or decode."""
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


def encode_prompt(engine: Engine, request: JobRequest, tools: ToolPlan) -> list[int]:
    """A local engine's prompt for the request: its template, with the tools and a forced call's
    opener of `tools` (plan_tools). Generation and count_tokens both encode through here."""
    return engine.encode_chat(request.messages, thinking=request.thinking, tools=tools.tools,
                              assistant_prefix=tools.assistant_prefix)


class GenerationWorker:
    """`max_batch`: generations in flight at once (scheduler.max_batch_for chooses it);
    `on_finished`: called after each job (adapt/record.py); `idle_work`: what runs in slices
    while no job waits or runs (adapt/idle.py: a job arriving waits at most one slice)."""

    def __init__(self, engine: Engine, max_queue: int = 8, max_batch: int = 1,
                 on_finished: Callable[[Job], None] | None = None,
                 idle_work: IdleWork | None = None):
        self.engine = engine
        self.idle_work = idle_work
        self.on_finished = on_finished or (lambda job: None)  # after each job: adapt/record.py
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.last: Job | None = None
        self.jobs_done = 0
        self.rounds_total = 0
        self.tool_support = ToolSupport.of(engine)  # the template's tool format, read once
        self.warmed = 0  # conversations whose next turn was warmed (turn_warmup.py)
        self.warm_ups_ended = 0  # warm-ups ended: stored, cut by a job, or nothing to do
        self._closed = False
        self._batch = RoundRobin(self.max_batch, max_queue)
        self._lanes = Lanes(engine.batch_costs)
        engine.share_rounds(self._lanes)  # its verifies batched, its prefills in chunks
        self._to_warm: deque[Job] = deque(maxlen=self.max_batch)  # finished while others ran
        self._thread = threading.Thread(target=self._serve, name="generation-worker", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        if self._closed:
            raise NoModelLoadedError("the model is being unloaded")
        self._batch.submit(job)

    @property
    def busy(self) -> bool:
        return self._batch.busy

    @property
    def current(self) -> Job | None:
        """The oldest generation in flight."""
        lanes = list(self._batch.lanes)
        return lanes[0].job if lanes else None

    def status(self) -> dict:
        running = [lane.job.summary() for lane in list(self._batch.lanes)]
        return {"busy": self.busy, "queued": len(self._batch.waiting), "max_queue": self.max_queue,
                "max_batch": self.max_batch, "running": running, "current": (running or [None])[0],
                "last": self.last.summary() if self.last else None, "warmed": self.warmed,
                "jobs_done": self.jobs_done, "rounds_total": self.rounds_total,
                "verify_batches": self._lanes.batches, "verifies": self._lanes.verifies,
                "proposal_batches": self._lanes.proposal_batches, "proposals": self._lanes.proposals}

    def retire(self, on_idle: Callable[[], None]) -> None:
        """Refuse new jobs, finish the ones already taken, then call `on_idle` (free the engine):
        a pair replaced by a load ends its clients' replies instead of cutting them."""
        self._closed = True

        def drain() -> None:
            self._batch.stop()  # after the waiting jobs and the lanes in flight
            self._thread.join()
            on_idle()

        threading.Thread(target=drain, name="generation-worker-retire", daemon=True).start()

    def close(self, timeout: float = 30.0) -> None:
        """Refuse new jobs, fail the waiting ones, cancel those in flight, stop the thread."""
        self._closed = True
        for job in self._batch.take_waiting():
            job.outcome = "failed"
            job.put(Failed(NoModelLoadedError("the model was unloaded")))
        for lane in list(self._batch.lanes):
            lane.job.cancel()
        self._batch.stop()
        self._thread.join(timeout)

    def _serve(self) -> None:
        while True:
            idle = not self._batch.lanes
            if idle:
                self._warm_finished()
                if self._idle_slice():
                    continue  # then look for jobs again: one arriving waited one slice at most
            joining = self._batch.joining(block=idle, timeout=IDLE_POLL_S if self.idle_work else None)
            if joining is None:
                self.engine.share_rounds(None)
                return
            if not joining and not self._batch.lanes:
                continue  # the poll: idle work may have come with no job (`adapt reset`)
            self._admit(joining)  # and again mid-tick, before the verifies (lanes.py)
            mid_tick = lambda: self._admit(self._batch.joining(block=False) or [])
            for lane in self._lanes.tick(list(self._batch.lanes), mid_tick):
                self._batch.remove(lane)
                self.last = lane.job
                self.jobs_done += 1
                self.on_finished(lane.job)
                self._to_warm.append(lane.job)

    def _admit(self, jobs: list[Job]) -> list[Lane]:
        """A lane in flight for each job but one whose client left while it waited."""
        joined = []
        for job in jobs:
            if job.cancelled:
                job.outcome = "cancelled"
                continue
            joined.append(self._lanes.lane(job, partial(self._run, job)))
            self._batch.add(joined[-1])
        return joined

    def _warm_finished(self) -> None:
        """The finished jobs' next turns, newest first, while nothing runs and nothing waits;
        then the heap the batch freed goes back to the system (heap.py), once a drain."""
        if not self._to_warm:
            return
        while self._to_warm and not self._closed and not self._batch.waiting:
            self._warm_next_turn(self._to_warm.pop())
        if not self._to_warm:
            trim_heap()

    def _idle_slice(self) -> bool:
        """One slice of the idle work, when there is some and no job waits; False: none ran."""
        work = self.idle_work
        if work is None or self._closed or self._batch.waiting or not work.has_work():
            return False
        try:
            work.run_slice()
        except Exception:  # the worker's edge: a failed slice must not stop serving
            log.exception("idle work failed: it stops until the next load")
            self.idle_work = None
        return True

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
                                          job.prompt_ids, request.params, request.thinking,
                                          lambda: self._closed or bool(self._batch.waiting)):
                self.warmed += 1
        except Exception:  # the worker's edge: a failed warm-up costs the next turn time only
            log.exception("warming the prefix cache after %s failed", job.id)
        finally:
            self.warm_ups_ended += 1

    def _run(self, job: Job) -> None:
        """The job's generation, run in its lane; its outcome goes to the job when it ends."""
        job.outcome = "running"
        try:
            stats = None if job.cancelled else self._generate(job)
        except GenerationCancelled:  # while its prompt was prefilling (lanes.py)
            stats = None
        except DFlashError as exc:
            job.outcome = "failed"
            job.put(Failed(exc))
            return
        except (GeneratorExit, KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # the worker's edge (a native panic included): log, tell, go on
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
        """The stats, or None when cancelled (at the round's end: a cancel costs at most the
        round already running); the other lanes run at its verifies and prefill chunks."""
        request = job.request
        stats = GenerationStats(drafter_version=self.engine.drafter_version)  # swaps wait for idle
        stops = StopMatcher(request.stop)
        # only local engines declare logprobs (chat.job_request refuses the others): they have a tokenizer
        logprobs = (LogprobEntries(self.engine.tokenizer, completions=request.raw_prompt is not None)
                    if request.params.logprobs is not None else None)
        tools = (NO_TOOLS if request.raw_prompt is not None  # a completion's text is raw: no channel split
                 else plan_tools(self.tool_support, request.tools, request.tool_choice))
        stream = self._open_stream(job, tools, logprobs)
        try:
            for event in stream:
                stats.add(event)
                job.reply_ids.extend(event.token_ids)
                if event.round_index > 0:
                    job.rounds += 1
                    self.rounds_total += 1
                finish = self._deliver(job, event, stops, logprobs, tools)
                if finish:
                    stats.finish_reason = finish
                    return stats
                if job.cancelled:
                    return None
        finally:
            stream.close()  # stops the engine's loop; its per-generation state is dropped
        return stats

    def _deliver(self, job: Job, event: StepEvent, stops: StopMatcher,
                 logprobs: LogprobEntries | None, tools: ToolPlan) -> str | None:
        """The round's chunk to the job (stop strings applied, calls taken out); its finish."""
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
        return finish

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
            job.prefill_started = time.monotonic()  # the server's prefill, until its first token
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
