"""Calibration of batched forwards: what one verify over several generations' rows costs, as a
function of its lanes and the rows it holds in all, and the drafter's batched pass likewise;
each fitted as a fixed cost (shared), a price per lane and one per row (planning/costs.LinearCost),
which the auto planner shares
out among the lanes of a batch (RoundCosts.in_batch) and the worker's lanes split each batch's
time by (service/lanes.py).

Timed through the batched calls the engine declares (`batched_calls`: its runner class's
`verify_batch` and its drafter class's `propose_batch`, the calls the lanes make), over
BATCH_LANES runners (each its own drafter session) on the same
short context, every lane drafting the same width: each of `batch_widths` on one runner and on
BATCH_LANES runners. A real batch rather than one runner's wide verify: a ragged batch attends per
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

BATCH_LANES = 4  # runners in the widest timed batch: a few clients at once
# one runner's batch and BATCH_LANES runners': what each lane adds apart from its rows (a ragged
# batch attends and gathers per runner) is told from what every lane shares
BATCH_LANE_COUNTS = (1, BATCH_LANES)
BATCH_REPETITIONS = 2  # of each batch, after one warm-up pass: it runs at every first load


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
    """The batched verify's and drafter pass's costs (the lower quartile of the repetitions of
    each batch, then `fit_batches`); None where the engine declares no batched verify. The
    drafter's fit is None where it declares no batched drafter pass."""
    verify_batch, propose_batch = engine.batched_calls()
    if verify_batch is None:
        return None
    runners = [engine.make_runner(collect_taps=True) for _ in range(BATCH_LANES)]
    drafters = [engine.make_drafter() for _ in runners]
    propose_batch = propose_batch if drafters[0] is not None else None
    anchor_id = context_ids[-1]
    for runner, drafter in zip(runners, drafters):
        _, taps = runner.prefill(context_ids)
        if drafter is not None:
            drafter.propose(anchor_id, taps, 2)  # the context enters each drafter's cache once
    shapes = [(lanes, width) for lanes in BATCH_LANE_COUNTS for width in batch_widths(block)]
    filler = (context_ids * block)[:block]
    verify_s: dict[tuple[int, int], list[float]] = {shape: [] for shape in shapes}
    draft_s: dict[tuple[int, int], list[float]] = {shape: [] for shape in shapes if shape[1] > 1}
    order = random.Random(0)
    for repetition in range(repetitions + 1):  # the first pass warms up
        order.shuffle(shapes)
        for lanes, width in shapes:
            tree, anchors = DraftTree.chain(filler[: width - 1]), [anchor_id] * lanes
            started = timer()
            verify_batch(runners[:lanes], anchors, [tree] * lanes)
            verified = timer()
            new_taps = [runner.commit([0]) for runner in runners[:lanes]]
            if propose_batch is not None and width > 1:
                proposing = timer()
                propose_batch(drafters[:lanes], anchors, new_taps, [width] * lanes)
                if repetition:
                    draft_s[lanes, width].append(timer() - proposing)
            if repetition:
                verify_s[lanes, width].append(verified - started)
    draft = fit_batches(draft_s) if propose_batch is not None and draft_s else None
    return BatchCosts(fit_batches(verify_s), draft)


def fit_batches(seconds: dict[tuple[int, int], list[float]]) -> LinearCost:
    """fixed_s + lane_s x lanes + row_s x total rows, least squares through each (lanes, width)
    batch's lower quartile (total rows: lanes x width), every part >= 0: of the fits that leave
    out a part (at 0), the closest whose parts are all >= 0 (a noisy point cannot make rows, lanes
    or the forward free of cost)."""
    shapes = sorted(seconds)
    columns = np.array([[1.0, lanes, lanes * width] for lanes, width in shapes])
    timed = np.array([lower_quartile(seconds[shape]) for shape in shapes])
    best: tuple[float, np.ndarray] | None = None
    for kept in ((0, 1, 2), (1, 2), (0, 2), (2,)):  # the rows' price is always fitted
        part, *_ = np.linalg.lstsq(columns[:, kept], timed, rcond=None)
        if np.all(part >= 0):
            coefficients = np.zeros(3)
            coefficients[list(kept)] = part
            error = float(np.sum((columns @ coefficients - timed) ** 2))
            if best is None or error < best[0]:
                best = (error, coefficients)
    fixed_s, lane_s, row_s = best[1] if best is not None else (0.0, 0.0, float(timed.mean()))
    return LinearCost(float(fixed_s), float(row_s), float(lane_s))
