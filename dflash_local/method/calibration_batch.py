"""Calibration of batched forwards: what one verify over several generations' rows costs, as a
function of the rows it holds in all, and the drafter's batched pass likewise; each fitted as
a fixed cost plus a price per row (planning/costs.LinearCost), which the auto planner shares
out among the lanes of a batch (RoundCosts.in_batch) and the worker's lanes split each batch's
time by (service/lanes.py).

Timed through the batched calls the engine declares (`batched_calls`: its runner class's
`verify_batch` and its drafter class's `propose_batch`, the calls the lanes make), over
BATCH_LANES runners (each its own drafter session) on the same
short context, every lane drafting the same width: total rows BATCH_LANES x each of
`batch_widths`. A real batch rather than one runner's wide verify: a ragged batch attends per
runner and gathers each runner's rows, which a single wide verify would not pay. Where the
engine declares no batched call, the calls run one after another and nothing is shared: no fit.

Boundary: timing and fitting only, through the engine's parts (no framework import here).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np

from dflash_local.method.calibration_noise import lower_quartile
from dflash_local.method.draft_tree import DraftTree
from dflash_local.method.interfaces import Drafter, TargetRunner
from dflash_local.method.planning.costs import BatchCosts, LinearCost

BATCH_LANES = 4  # runners in each timed batch: a few clients at once
BATCH_REPETITIONS = 3  # of each width, after one warm-up pass: it runs at every first load


class BatchMeasurable(Protocol):
    """What the batched forwards are timed through: a local engine's per-generation parts."""

    def make_runner(self, collect_taps: bool) -> TargetRunner: ...
    def make_drafter(self) -> Drafter | None: ...

    def batched_calls(self) -> tuple[Callable | None, Callable | None]:
        """(verify_batch, propose_batch): one forward over several runners' verifies, one drafter
        pass over several sessions' proposals, as the worker's lanes run them; None: none."""


def batch_widths(block: int) -> list[int]:
    """Each lane's width in the timed batches: a plain step, the narrowest draft, a quarter and
    the whole block (total rows from BATCH_LANES to BATCH_LANES x block)."""
    return sorted({1, min(2, block), max(1, block // 4), block})


def measure_batch(engine: BatchMeasurable, context_ids: list[int], block: int,
                  repetitions: int = BATCH_REPETITIONS,
                  timer: Callable[[], float] = time.perf_counter) -> BatchCosts | None:
    """The batched verify's and drafter pass's costs per total rows (the lower quartile of the
    repetitions at each width, then a least-squares line); None where the engine declares no
    batched verify. The drafter's fit is None where it declares no batched drafter pass."""
    verify_batch, propose_batch = engine.batched_calls()
    if verify_batch is None:
        return None
    runners = [engine.make_runner(collect_taps=True) for _ in range(BATCH_LANES)]
    drafters = [engine.make_drafter() for _ in runners]
    propose_batch = propose_batch if drafters[0] is not None else None
    anchors = [context_ids[-1]] * len(runners)
    for runner, drafter in zip(runners, drafters):
        _, taps = runner.prefill(context_ids)
        if drafter is not None:
            drafter.propose(anchors[0], taps, 2)  # the context enters each drafter's cache once
    widths = batch_widths(block)
    filler = (context_ids * block)[:block]
    verify_s: dict[int, list[float]] = {w: [] for w in widths}
    draft_s: dict[int, list[float]] = {w: [] for w in widths if w > 1}
    order = random.Random(0)
    for repetition in range(repetitions + 1):
        order.shuffle(widths)
        for width in widths:
            trees = [DraftTree.chain(filler[: width - 1])] * len(runners)
            started = timer()
            verify_batch(runners, anchors, trees)
            verified = timer()
            new_taps = [runner.commit([0]) for runner in runners]
            if propose_batch is not None and width > 1:
                proposing = timer()
                propose_batch(drafters, anchors, new_taps, [width] * len(drafters))
                if repetition:
                    draft_s[width].append(timer() - proposing)
            if repetition:  # the first pass warms up
                verify_s[width].append(verified - started)
    draft = fit_rows(draft_s, len(runners)) if propose_batch is not None and draft_s else None
    return BatchCosts(fit_rows(verify_s, len(runners)), draft)


def fit_rows(seconds_by_width: dict[int, list[float]], lanes: int) -> LinearCost:
    """fixed_s + row_s x total rows through each width's lower quartile (total rows: `lanes` x
    width), both kept >= 0 (a noisy point cannot make rows or the forward free of cost)."""
    rows = [lanes * width for width in sorted(seconds_by_width)]
    seconds = [lower_quartile(seconds_by_width[width]) for width in sorted(seconds_by_width)]
    if len(rows) < 2:  # one point: all of it fixed
        return LinearCost(max(0.0, seconds[0]), 0.0)
    row_s, fixed_s = np.polyfit(rows, seconds, 1)
    row_s = max(0.0, float(row_s))
    if fixed_s < 0:  # the line through the points' mean with the fixed cost at 0
        row_s = float(np.mean(seconds) / np.mean(rows))
        fixed_s = 0.0
    return LinearCost(float(fixed_s), row_s)
