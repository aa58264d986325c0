"""Cooperative lanes: the generations in flight share the worker thread, each a greenlet that
runs its own loop (method/speculative.py, unchanged) until it needs the scheduler: at its
drafter's proposal and at its verify, which it hands in to be batched, and between two chunks
of its prompt's prefill or of an echo's scoring (method/shared_rounds.py is the runner and the
drafter that make those calls).

One tick (`Lanes.tick`):
1. of the lanes still prefilling, one runs one chunk (the one with the fewest chunks run, the
   older on a tie), first, so a newcomer's first token waits for no other lane's step; the
   streams already running wait at most one chunk a tick, however many prompts join. Then
   each lane runs until it parks, in the order they joined: a lane whose verify was answered
   accepts and commits it, sends its round's chunk, then plans its next round up to that
   round's drafter call (a plain step or a lookup draft has none: up to its verify); a lane
   that ends leaves.
2. the proposals handed in run as one batch per drafter class and kind: its `propose_batch` /
   `propose_tree_batch` (one drafter pass over every session), else one after another
   (shared_rounds.propose_each); each of those lanes then runs on to its verify.
3. the jobs waiting join the free places (scheduler.py); when no lane prefilled in step 1, the
   first of them runs its first chunk now, on to its verify (in this batch) or its proposal
   (in the next tick's): a newcomer waits for one batch of the others', not a whole tick.
4. the verifies handed in run as one batch: the runner class's `verify_batch` (one forward over
   every generation's rows) where it has one, else one after another (shared_rounds.verify_each).
Between ticks the worker admits the waiting jobs into free places too. Each batch's time is
split among its asks as the engine's calibration prices a lane's part (`Engine.batch_costs`; by rows without
one), which each lane counts as its own, and `in_flight` tells every lane's auto planner how many
lanes share the batches (planning/costs.py: RoundCosts.in_batch).

Fair: every lane in flight gets a round every tick (one that joined mid-tick from the next),
jobs join in arrival order, and at most one prefill chunk runs a tick. A cancelled
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
from dflash_local.method.interfaces import Drafter, TargetRunner
from dflash_local.method.planning.costs import BatchCosts, LinearCost
from dflash_local.method.shared_rounds import propose_each, verify_each

Job = Any  # worker.Job: the worker imports this module, not the other way round


@dataclass
class VerifyAsk:
    """A verify a lane handed in; `answer`: its logits (or the batch's error), once run;
    `seconds`: its part of the batch's time (`_answer`)."""

    runner: TargetRunner
    anchor_id: int
    tree: DraftTree
    answer: np.ndarray | BaseException | None = None
    seconds: float = 0.0

    @property
    def args(self) -> tuple:
        return self.runner, self.anchor_id, self.tree

    @property
    def rows(self) -> int:
        return len(self.tree.token_ids) + 1


@dataclass
class ProposeAsk:
    """A drafter call a lane handed in: a chain of `size` (its width) or, `tree`, a tree of
    `size` nodes; `answer` and `seconds` as VerifyAsk's."""

    drafter: Drafter
    anchor_id: int
    new_taps: Any
    size: int
    tree: bool
    answer: list[int] | DraftTree | BaseException | None = None
    seconds: float = 0.0

    @property
    def args(self) -> tuple:
        return self.drafter, self.anchor_id, self.new_taps, self.size

    @property
    def rows(self) -> int:
        return self.size + 1 if self.tree else self.size


@dataclass(eq=False)
class Lane:
    """A generation in flight: its job and the greenlet that runs it."""

    job: Job
    greenlet: greenlet.greenlet
    asked: VerifyAsk | None = None  # its verify, handed in (answered or not)
    proposal: ProposeAsk | None = None  # its drafter call, handed in (until it resumes)
    prefilling: bool = True  # until its first verify
    chunks: int = 0  # prefill chunks run: the prefilling lanes' turns
    started: bool = False
    own_s: float = 0.0  # its own time (its clock), up to its last switch back to the tick
    resumed_at: float = 0.0

    @property
    def ended(self) -> bool:
        return self.greenlet.dead


class Lanes:
    """The worker's lanes and their batcher (method/shared_rounds.RoundSharing); runs on the
    worker thread only. Called outside a lane (a caller of its own), a proposal or a verify
    runs alone."""

    def __init__(self, batch_costs: Callable[[], BatchCosts | None] = lambda: None):
        self._running: Lane | None = None
        self.batches = 0  # verify batches run
        self.verifies = 0  # verifies in them
        self.proposal_batches = 0  # drafter batches run
        self.proposals = 0  # drafter calls in them
        self._in_flight = 1  # lanes in the latest tick
        self.batch_costs = batch_costs  # how a batch's time is split: the engine's calibration

    def lane(self, job: Job, run: Callable[[], None]) -> Lane:
        """A lane that runs `run` (the job's generation; it reports its own outcome). Made on the
        worker thread: its greenlet switches back there."""
        return Lane(job, greenlet.greenlet(run))

    def tick(self, lanes: list[Lane], admit: Callable[[], list[Lane]] = list) -> list[Lane]:
        """One step of every lane, then one batch of their proposals and one of their verifies;
        returns the lanes that ended. `admit`: the lanes joining now (the worker's waiting jobs
        in its free places), asked before the verifies: a newcomer's first chunk runs then, so
        its first token waits for one batch of the others', not a whole tick."""
        self._in_flight = max(1, len(lanes))
        turn = _prefill_turn(lanes)
        if turn is not None:  # first: its first token waits for no other lane's step
            self._resume(turn)
        for lane in lanes:  # one whose proposal waits (it joined mid-tick) has it in the batch
            if lane is not turn and lane.proposal is None and (not lane.prefilling
                                                              or lane.job.cancelled):
                self._resume(lane)
        self._propose_all(lanes)
        joined = admit()
        if joined and turn is None:  # the tick's one prefill chunk, unless a lane ran it
            self._resume(joined[0])  # on to its verify (this batch) or its proposal (the next)
        lanes = [*lanes, *joined]
        self._in_flight = max(1, len(lanes))
        asking = [lane for lane in lanes if not lane.ended and lane.asked is not None]
        self._run_batch([lane.asked for lane in asking])
        return [lane for lane in lanes if lane.ended]

    def _propose_all(self, lanes: list[Lane]) -> None:
        """Every proposal handed in, batched; each of those lanes then runs on to its verify."""
        while proposing := [lane for lane in lanes if lane.proposal is not None]:
            self._run_proposals([lane.proposal for lane in proposing])
            for lane in proposing:
                self._resume(lane)

    def propose(self, drafter: Drafter, anchor_id: int, new_taps: Any, size: int,
                tree: bool) -> list[int] | DraftTree:
        lane = self._lane_here()
        if lane is None:
            return propose_each(tree)([drafter], [anchor_id], [new_taps], [size])[0]
        lane.proposal, lane.prefilling = ProposeAsk(drafter, anchor_id, new_taps, size, tree), False
        return self._answered(lane, "proposal")

    def verify(self, runner: TargetRunner, anchor_id: int, tree: DraftTree) -> np.ndarray:
        lane = self._lane_here()
        if lane is None:
            return runner.verify(anchor_id, tree)
        lane.asked, lane.prefilling = VerifyAsk(runner, anchor_id, tree), False
        return self._answered(lane, "asked")

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

    def in_flight(self) -> int:
        """The lanes of the latest tick, prefilling ones included: they join the batches next."""
        return self._in_flight

    def _answered(self, lane: Lane, field: str) -> Any:
        """Park `lane` with its ask in `field`; once resumed, the ask's answer (its error raised),
        its part of the batch's time counted as the lane's own."""
        self._park(lane)
        ask = getattr(lane, field)
        setattr(lane, field, None)
        lane.own_s += ask.seconds
        if isinstance(ask.answer, BaseException):
            raise ask.answer
        return ask.answer

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
            prices = self.batch_costs()
            cost = prices.verify if prices else None
            for part in [group] if batched else [[ask] for ask in group]:
                _answer(part, batched or verify_each, cost)
            self.batches += 1
            self.verifies += len(group)

    def _run_proposals(self, asks: list[ProposeAsk]) -> None:
        """Each drafter class's chains, and its trees, as one call of its `propose_batch` /
        `propose_tree_batch` where the class declares one by having it; else one by one."""
        by_kind: dict[tuple[type, bool], list[ProposeAsk]] = {}
        for ask in asks:
            by_kind.setdefault((type(ask.drafter), ask.tree), []).append(ask)
        for (drafter_class, tree), group in by_kind.items():
            batched = getattr(drafter_class, "propose_tree_batch" if tree else "propose_batch", None)
            prices = self.batch_costs()
            cost = prices.draft if prices else None
            for part in [group] if batched else [[ask] for ask in group]:
                _answer(part, batched or propose_each(tree), cost)
            self.proposal_batches += 1
            self.proposals += len(group)


def _prefill_turn(lanes: list[Lane]) -> Lane | None:
    """The prefilling lane whose chunk runs this tick: the one with the fewest run, the older on
    a tie (a newcomer's short prompt goes before the rest of a long one)."""
    return min((lane for lane in lanes if lane.prefilling), key=lambda lane: lane.chunks,
               default=None)


def _answer(asks: list[VerifyAsk] | list[ProposeAsk], batch: Callable[..., list],
            cost: LinearCost | None = None) -> None:
    """Run `asks` as one call of `batch` (one list per argument, an item per ask); each gets its
    answer and its part of the time: as `cost` prices it (the forward's fixed cost split evenly,
    each ask's own part and rows at their price: as the auto planner prices a round in a batch,
    RoundCosts.in_batch), else by its rows."""
    start = time.perf_counter()
    try:
        answers = batch(*[list(column) for column in zip(*(ask.args for ask in asks))])
    except Exception as exc:  # noqa: BLE001 - the worker's edge: a failed pass leaves every
        answers = [exc] * len(asks)  # session's state unknown, so each lane of it fails with it
    elapsed = time.perf_counter() - start
    rows = [ask.rows for ask in asks]
    shares = cost.shares(rows) if cost is not None else [r / sum(rows) for r in rows]
    for ask, answer, share in zip(asks, answers, shares, strict=True):
        ask.answer, ask.seconds = answer, elapsed * share
