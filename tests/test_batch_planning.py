"""Planning with a batch: a lane's round priced as its part of the batched forward (its share of
the fixed cost, its own rows), so a bigger batch plans narrower drafts, then plain; the lanes
split a batch's time by the same prices; calibration fits the batched costs (fixed + per row)
from batched calls, here timed on a scripted clock."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_local.events import GenerationParams, parse_block_size
from dflash_local.method.calibration_batch import (
    BATCH_LANES,
    batch_widths,
    fit_batches,
    measure_batch,
)
from dflash_local.method.planning.costs import BatchCosts, LinearCost, RoundCosts
from dflash_local.method.planning.planner import make_planner
from dflash_local.method.proposers import DrafterChain, NoDraft
from dflash_local.service import lanes as lanes_module
from dflash_local.service.lanes import VerifyAsk

BLOCK = 16
VERIFY = LinearCost(fixed_s=0.05, row_s=0.004, lane_s=0.004)  # the embedded target on a CPU, roughly
DRAFT = LinearCost(fixed_s=0.02, row_s=0.001, lane_s=0.002)


def linear_costs(batch: BatchCosts | None) -> RoundCosts:
    """A pair whose rounds alone cost exactly what the batch's lines say for one lane."""
    verify = tuple(VERIFY.seconds(w) for w in range(1, BLOCK + 1))
    rounds = (verify[0], *(v + DRAFT.seconds(w) for w, v in enumerate(verify[1:], 2)))
    return RoundCosts(rounds, verify, timed=True, batch=batch)


def planned_width(costs: RoundCosts, lanes: int) -> int:
    params = GenerationParams(block_size=parse_block_size("auto"), prompt_lookup=False)
    planner = make_planner(params, BLOCK, False, [1, 2, 3], costs, [0.7] * (BLOCK - 1),
                           lanes=lambda: lanes)
    proposer = planner.plan(context=40, remaining=200)
    assert isinstance(proposer, DrafterChain | NoDraft), proposer
    return proposer.width if isinstance(proposer, DrafterChain) else 1


def test_a_bigger_batch_plans_narrower_drafts_then_plain():
    costs = linear_costs(BatchCosts(VERIFY, DRAFT))
    widths = {lanes: planned_width(costs, lanes) for lanes in (1, 2, 4, 8, 16)}
    assert widths[1] > widths[4] > 1, widths  # still drafting at 4, narrower
    assert widths[16] == 1, widths  # a plain step pays more with many lanes
    assert list(widths.values()) == sorted(widths.values(), reverse=True), widths
    unbatched = linear_costs(None)  # nothing shared (no batched forward): the same at any count
    assert planned_width(unbatched, 16) == planned_width(unbatched, 1) == widths[1]


def test_a_lane_in_a_batch_pays_its_share_of_the_fixed_cost_and_its_own_rows():
    costs = linear_costs(BatchCosts(VERIFY, DRAFT))
    assert costs.in_batch(1) is costs
    shared = costs.in_batch(4)
    for width in range(1, BLOCK + 1):
        assert shared.verify_only[width - 1] == pytest.approx(
            VERIFY.fixed_s / 4 + VERIFY.lane_s + VERIFY.row_s * width)
    assert shared.draft_seconds(5) == pytest.approx(DRAFT.fixed_s / 4 + DRAFT.lane_s + DRAFT.row_s * 5)
    # a fixed cost fitted above the whole step it is part of never makes a round free
    greedy = linear_costs(BatchCosts(LinearCost(1.0, 0.0), LinearCost(1.0, 0.0)))
    assert min(greedy.in_batch(1000).seconds) > 0 and min(greedy.in_batch(1000).verify_only) > 0
    # nor where re-priced wider rounds (planning/observed.py) cost less than a plain step
    repriced = RoundCosts((1.0, 0.3, 0.4), (1.0, 0.1, 0.2), batch=BatchCosts(VERIFY, DRAFT)).scaled(1.0, 0.1)
    assert min(repriced.in_batch(1000).seconds) > 0 and min(repriced.in_batch(1000).verify_only) > 0


def test_the_lanes_split_a_batch_as_the_planner_prices_each_lanes_part():
    """Each verify's part of a batch's time in the ratio of the lanes' prices in that batch, so a
    lane's timed rounds compare like with like (planning/observed.py)."""
    asks = [VerifyAsk(None, 0, _chain(rows)) for rows in (1, 4, 16)]
    lanes_module._answer(asks, lambda runners, anchors, trees: [None] * len(trees), VERIFY)
    priced = linear_costs(BatchCosts(VERIFY)).in_batch(len(asks)).verify_only
    expected = np.array([priced[ask.rows - 1] for ask in asks])
    seconds = np.array([ask.seconds for ask in asks])
    assert seconds.sum() > 0
    np.testing.assert_allclose(seconds / seconds.sum(), expected / expected.sum())
    lanes_module._answer(asks, lambda runners, anchors, trees: [None] * len(trees))  # unpriced
    np.testing.assert_allclose([ask.seconds / asks[0].seconds for ask in asks], [1, 4, 16])


def _chain(rows: int):
    from dflash_local.method.draft_tree import DraftTree

    return DraftTree.chain(tuple(range(5, 4 + rows)))


class ScriptedClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeRunner:
    """A runner whose batched verify advances the clock as `VERIFY` prices its lanes and total
    rows, the widest batch once much slower (a busy moment the lower quartile must ignore)."""

    clock: ScriptedClock
    stalls = 1

    def prefill(self, prompt_ids, start=0):
        return None, "taps"

    def commit(self, rows):
        return "taps"

    @staticmethod
    def verify_batch(runners, anchors, trees):
        rows = sum(len(tree.token_ids) + 1 for tree in trees)
        FakeRunner.clock.now += VERIFY.seconds(rows, len(runners))
        if rows == BATCH_LANES * BLOCK and FakeRunner.stalls:
            FakeRunner.stalls -= 1
            FakeRunner.clock.now += 5.0
        return [None] * len(runners)


class FakeDrafter:
    clock: ScriptedClock

    def propose(self, anchor_id, new_taps, width):
        return [0] * width

    @staticmethod
    def propose_batch(sessions, anchors, new_taps, widths):
        FakeDrafter.clock.now += DRAFT.seconds(sum(widths), len(sessions))
        return [[0] * w for w in widths]


class FakeEngine:
    def __init__(self, runner_class=FakeRunner, drafter_class=FakeDrafter):
        self.runner_class, self.drafter_class = runner_class, drafter_class

    def make_runner(self, collect_taps):
        return self.runner_class()

    def make_drafter(self):
        return self.drafter_class()

    def batched_calls(self):
        return self.runner_class.verify_batch, self.drafter_class.propose_batch


def test_the_fit_keeps_every_part_of_the_cost_at_least_zero():
    # more lanes cost less here (noise): the lanes' part is left out, not fitted below zero
    seconds = {(1, 1): [0.10], (1, 4): [0.13], (4, 1): [0.07], (4, 4): [0.16]}
    fit = fit_batches(seconds)
    assert min(fit.fixed_s, fit.lane_s, fit.row_s) >= 0 and fit.lane_s == 0 and fit.row_s > 0


def test_calibration_fits_the_batched_costs_from_batched_calls(monkeypatch):
    clock = ScriptedClock()
    monkeypatch.setattr(FakeRunner, "clock", clock, raising=False)
    monkeypatch.setattr(FakeDrafter, "clock", clock, raising=False)
    monkeypatch.setattr(FakeRunner, "stalls", 1)
    batch = measure_batch(FakeEngine(), [1, 2, 3, 4], BLOCK, timer=clock)
    assert batch.verify.fixed_s == pytest.approx(VERIFY.fixed_s)
    assert batch.verify.lane_s == pytest.approx(VERIFY.lane_s)
    assert batch.verify.row_s == pytest.approx(VERIFY.row_s)
    assert batch.draft.fixed_s == pytest.approx(DRAFT.fixed_s)
    assert batch.draft.lane_s == pytest.approx(DRAFT.lane_s) and batch.draft.row_s == pytest.approx(DRAFT.row_s)
    assert FakeRunner.stalls == 0  # the stall happened, and the fit left it out
    assert batch_widths(BLOCK) == [1, 2, 4, 16] and batch_widths(2) == [1, 2]

    class OneByOneDrafter(FakeDrafter):  # drafter calls run one after another: nothing shared
        propose_batch = None

    assert measure_batch(FakeEngine(drafter_class=OneByOneDrafter), [1, 2], BLOCK,
                         timer=clock).draft is None

    class OneByOneRunner(FakeRunner):
        verify_batch = None

    assert measure_batch(FakeEngine(OneByOneRunner), [1, 2], BLOCK, timer=clock) is None
