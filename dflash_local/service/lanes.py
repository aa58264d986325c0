"""Cooperative lanes: the generations in flight share the worker thread, each a greenlet that
runs its own loop (method/speculative.py, unchanged) until it needs the scheduler: at its
verify, which it hands in to be batched, and between two chunks of its prompt's prefill or of
an echo's scoring (method/shared_rounds.py is the runner that makes those calls).

One tick (`Lanes.tick`):
1. each lane runs until it parks, in the order they joined: a lane whose verify was answered
   accepts and commits it, sends its round's chunk, then plans and proposes its next round up
   to that round's verify; a lane that ends leaves. Of the lanes still prefilling, one runs one
   chunk a tick (the one with the fewest chunks run, the older on a tie), so the streams already
   running wait at most one chunk a tick, however many prompts join.
2. the verifies handed in run as one batch: the runner class's `verify_batch` (one forward over
   every generation's rows) where it has one, else one after another (shared_rounds.verify_each).
Between ticks the worker admits the waiting jobs into free places (scheduler.py).

Fair: every lane in flight gets a round every tick, and jobs join in arrival order. A cancelled
lane leaves at its next switch point: while prefilling, at once (nothing kept); with a verify in
the batch, at the end of that round, its state kept as a stream closed between rounds is.

Why greenlets rather than a thread per lane passing a baton: one thread, switched only at the
points named above, so the model's state never needs a lock, lanes run in the same order on
every run (outputs reproducible), and a switch costs about a microsecond, not a trip through the
GIL and the OS's wake-ups.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import greenlet
import numpy as np

from dflash_local.errors import GenerationCancelled
from dflash_local.method.draft_tree import DraftTree
from dflash_local.method.interfaces import TargetRunner
from dflash_local.method.shared_rounds import verify_each

Job = Any  # worker.Job: the worker imports this module, not the other way round


@dataclass
class VerifyAsk:
    """A verify a lane handed in; `logits`: its answer (or the batch's error), once run;
    `seconds`: its part of the batch's time, by its rows."""

    runner: TargetRunner
    anchor_id: int
    tree: DraftTree
    logits: np.ndarray | BaseException | None = None
    seconds: float = 0.0


@dataclass(eq=False)
class Lane:
    """A generation in flight: its job and the greenlet that runs it."""

    job: Job
    greenlet: greenlet.greenlet
    asked: VerifyAsk | None = None  # its verify, handed in (answered or not)
    prefilling: bool = True  # until its first verify
    chunks: int = 0  # prefill chunks run: the prefilling lanes' turns
    started: bool = False
    own_s: float = 0.0  # its own time (its clock), up to its last switch back to the tick
    resumed_at: float = 0.0

    @property
    def ended(self) -> bool:
        return self.greenlet.dead


class Lanes:
    """The worker's lanes and their verify batcher (method/shared_rounds.RoundSharing); runs on
    the worker thread only. Called outside a lane (a caller of its own), a verify runs alone."""

    def __init__(self):
        self._running: Lane | None = None
        self.batches = 0  # verify batches run
        self.verifies = 0  # verifies in them

    def lane(self, job: Job, run: Callable[[], None]) -> Lane:
        """A lane that runs `run` (the job's generation; it reports its own outcome). Made on the
        worker thread: its greenlet switches back there."""
        return Lane(job, greenlet.greenlet(run))

    def tick(self, lanes: list[Lane]) -> list[Lane]:
        """One step of every lane, then one batch of their verifies; returns the lanes that ended."""
        prefilling = [lane for lane in lanes if lane.prefilling]
        turn = min(prefilling, key=lambda lane: lane.chunks, default=None)
        for lane in lanes:
            if lane is turn or not lane.prefilling or lane.job.cancelled:
                self._resume(lane)
        asking = [lane for lane in lanes if not lane.ended and lane.asked is not None]
        self._run_batch([lane.asked for lane in asking])
        return [lane for lane in lanes if lane.ended]

    def verify(self, runner: TargetRunner, anchor_id: int, tree: DraftTree) -> np.ndarray:
        lane = self._lane_here()
        if lane is None:
            return runner.verify(anchor_id, tree)
        lane.asked, lane.prefilling = VerifyAsk(runner, anchor_id, tree), False
        self._park(lane)
        logits, lane.own_s, lane.asked = lane.asked.logits, lane.own_s + lane.asked.seconds, None
        if isinstance(logits, BaseException):
            raise logits
        return logits

    def pause(self) -> None:
        lane = self._lane_here()
        if lane is not None:
            lane.chunks += 1
            self._park(lane)

    def clock(self) -> float:
        lane = self._lane_here()
        if lane is None:
            return time.perf_counter()
        return lane.own_s + time.perf_counter() - lane.resumed_at

    def _lane_here(self) -> Lane | None:
        lane = self._running
        return lane if lane is not None and greenlet.getcurrent() is lane.greenlet else None

    def _park(self, lane: Lane) -> None:
        """Back to the tick; returns when the tick resumes this lane."""
        self._running = None
        lane.greenlet.parent.switch()

    def _resume(self, lane: Lane) -> None:
        """Run the lane to its next switch point (or its end); one cancelled while prefilling
        unwinds from where it paused (one not started yet ends at its start)."""
        leaving = lane.started and lane.prefilling and lane.job.cancelled
        self._running, lane.started, lane.resumed_at = lane, True, time.perf_counter()
        try:
            if leaving:
                lane.greenlet.throw(GenerationCancelled("the generation was cancelled"))
            else:
                lane.greenlet.switch()
        finally:
            self._running = None
            lane.own_s += time.perf_counter() - lane.resumed_at

    def _run_batch(self, asks: list[VerifyAsk]) -> None:
        """Each runner class's asks as one call of its `verify_batch`, where the class declares
        one by having it; else one `verify_each` call per ask (each timed on its own)."""
        by_class: dict[type, list[VerifyAsk]] = {}
        for ask in asks:
            by_class.setdefault(type(ask.runner), []).append(ask)
        for runner_class, group in by_class.items():
            batched = getattr(runner_class, "verify_batch", None)
            for part in [group] if batched else [[ask] for ask in group]:
                _answer(part, batched or verify_each)
            self.batches += 1
            self.verifies += len(group)


def _answer(asks: list[VerifyAsk], batch: Callable[..., list[np.ndarray]]) -> None:
    """Run `asks` as one call of `batch`; each gets its logits and its rows' part of the time."""
    start = time.perf_counter()
    try:
        answers = batch([ask.runner for ask in asks], [ask.anchor_id for ask in asks],
                        [ask.tree for ask in asks])
    except Exception as exc:  # noqa: BLE001 - the worker's edge: a failed forward leaves every
        answers = [exc] * len(asks)  # runner's state unknown, so each lane of it fails with it
    elapsed = time.perf_counter() - start
    rows = [len(ask.tree.token_ids) + 1 for ask in asks]
    for ask, logits, ask_rows in zip(asks, answers, rows, strict=True):
        ask.logits, ask.seconds = logits, elapsed * ask_rows / sum(rows)
