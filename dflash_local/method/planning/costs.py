"""What a round costs and what it is expected to commit: the arithmetic every planner prices with.

With a_j = P(draft j accepted | drafts 1..j-1 accepted), a round of width w commits

    E[committed | w] = 1 + sum_{k=1..w-1} a_1 * a_2 * ... * a_k     (the bonus token included)

and a planner compares E[committed | w] / cost(w) across widths and kinds of round. The costs are
this machine's, measured at load (calibration.py). Where several generations' rounds run as
one batched forward (service/lanes.py), a lane's round costs its part of the batch: its share
of the forward's fixed cost plus its own rows (RoundCosts.in_batch), so a big batch prices wide
rounds dearer next to a plain step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_PRIOR = 0.5  # per-position acceptance assumed without a calibration run
DEFAULT_COST_SLOPE = 0.06  # uncalibrated: each extra row costs 6% of a plain step (CPU, small B)
# the most of a lane's cheapest verify (and drafter pass) a batch may share out: a fitted fixed
# cost larger than the step it is part of is noise, and no round is ever free
MAX_SHARED = 0.95


@dataclass(frozen=True)
class LinearCost:
    """One batched forward over several lanes' rows: `fixed_s` (reading the weights, paid once
    per forward however many lanes share it) + `lane_s` per lane (what a ragged batch does per
    lane: its attention, its cache) + `row_s` per row (calibration_batch.py fits all three)."""

    fixed_s: float
    row_s: float
    lane_s: float = 0.0

    def seconds(self, rows: int, lanes: int = 1) -> float:
        return self.fixed_s + self.lane_s * lanes + self.row_s * rows

    def shares(self, rows: Sequence[int]) -> list[float]:
        """Each lane's share (they sum to 1) of one forward over lanes of these rows: the fixed
        cost split evenly among the lanes, each lane's own cost and rows at their price."""
        parts = [self.fixed_s / len(rows) + self.lane_s + self.row_s * lane_rows for lane_rows in rows]
        total = sum(parts)
        return [part / total for part in parts] if total > 0 else [1.0 / len(rows)] * len(rows)


@dataclass(frozen=True)
class BatchCosts:
    """What batching the lanes' rounds shares (service/lanes.py): the target's batched verify,
    and the drafter's batched pass (None: its calls run one after another, nothing shared)."""

    verify: LinearCost
    draft: LinearCost | None = None

    def to_json(self) -> dict:
        def parts(cost):
            return None if cost is None else {"fixed_s": cost.fixed_s, "lane_s": cost.lane_s,
                                               "row_s": cost.row_s}
        return {"verify": parts(self.verify), "draft": parts(self.draft)}

    @classmethod
    def from_json(cls, raw: dict) -> BatchCosts:
        draft = raw.get("draft")
        return cls(LinearCost(**raw["verify"]), LinearCost(**draft) if draft else None)


@dataclass(frozen=True)
class RoundCosts:
    """seconds[w - 1] = one round of width w: verify + commit, plus the drafter pass when w > 1.
    verify_seconds[w - 1] = the same without the drafter pass (a prompt-lookup round); unknown
    (None), a lookup round is priced like a drafter round, which only makes lookup rarer.

    Both were timed on `base_context` tokens of context. A verify reads the whole cache, and a
    wide one grows dearer with the context faster than a 1-row step (MLX on a CPU: a 16-row
    verify of the embedded target adds about four times what one row adds per token of context):
    `context_slopes[w - 1]` is the seconds each token of context past `base_context` adds to a
    round of width w (`at_context`).

    `timed`: seconds this machine measured (calibration.py), which the auto planner corrects
    when the rounds it times disagree (observed.py); False: assumed costs in any unit (the
    uncalibrated defaults, a test's), never compared with a clock. `reliable`: False where the
    calibration that timed them was noisy (calibration_noise.py): auto probes sooner to check
    them (auto.py). `batch`: what a batched forward costs (None: unknown, or nothing batches),
    for `in_batch`."""

    seconds: tuple[float, ...]
    verify_seconds: tuple[float, ...] | None = None
    base_context: int = 0
    context_slopes: tuple[float, ...] | None = None
    timed: bool = False
    reliable: bool = True
    batch: BatchCosts | None = None

    def __post_init__(self):
        if not self.seconds or any(not s > 0 for s in self.seconds):
            raise ValueError(f"round costs must be positive seconds per width, got {self.seconds!r}")
        verify = self.verify_seconds
        if verify is not None and (len(verify) != len(self.seconds) or any(not s > 0 for s in verify)):
            raise ValueError(f"verify costs must be positive seconds for each width, got {verify!r}")
        slopes = self.context_slopes
        if slopes is not None and (len(slopes) != len(self.seconds) or any(not s >= 0 for s in slopes)):
            raise ValueError(f"context slopes must be seconds >= 0 for each width, got {slopes!r}")

    def at_context(self, tokens: int) -> RoundCosts:
        """The costs of a round on `tokens` of context (never below the timed ones); a priced
        copy, without slopes: price from the calibrated costs each time."""
        if not self.context_slopes or tokens <= self.base_context:
            return self
        extra = [(tokens - self.base_context) * slope for slope in self.context_slopes]
        return RoundCosts(tuple(s + e for s, e in zip(self.seconds, extra)),
                          tuple(v + e for v, e in zip(self.verify_only, extra)), tokens,
                          timed=self.timed, reliable=self.reliable, batch=self.batch)

    def in_batch(self, lanes: int) -> RoundCosts:
        """One lane's part of these rounds while `lanes` lanes' rounds run as one batched verify
        and one drafter pass: each forward's fixed cost split among the lanes, the lane's own rows
        (and the lane's own part of the forward) at their price as timed alone. Alone, or without
        batch costs, these costs; a priced copy
        (without `batch`) otherwise."""
        if lanes <= 1 or self.batch is None:
            return self
        kept_out = 1.0 - 1.0 / lanes  # of each fixed cost, what the other lanes pay
        verify = self.verify_only
        drafts = [0.0, *(self.draft_seconds(w) for w in range(2, self.max_width + 1))]
        verify_saved = kept_out * min(self.batch.verify.fixed_s, MAX_SHARED * min(verify))
        draft_saved = 0.0
        if self.batch.draft is not None and self.max_width > 1:
            draft_saved = kept_out * min(self.batch.draft.fixed_s, MAX_SHARED * min(drafts[1:]))
        verify = tuple(v - verify_saved for v in verify)
        drafts = [0.0, *(d - draft_saved for d in drafts[1:])]
        return RoundCosts(tuple(v + d for v, d in zip(verify, drafts)), verify, self.base_context,
                          timed=self.timed, reliable=self.reliable)

    def scaled(self, plain: float, wider: float) -> RoundCosts:
        """These costs with a plain step's times `plain` times and every wider round's (drafter
        pass, verify and context slope) `wider` times as dear."""
        def scale(values):
            return None if values is None else (values[0] * plain, *(v * wider for v in values[1:]))
        return RoundCosts(scale(self.seconds), scale(self.verify_seconds), self.base_context,
                          scale(self.context_slopes), self.timed, self.reliable, self.batch)

    @property
    def max_width(self) -> int:
        return len(self.seconds)

    def at(self, width: int) -> float:
        return self.seconds[width - 1]

    def draft_seconds(self, width: int) -> float:
        """The drafter pass of a round of this width (its cost over the verify alone)."""
        return self.at(width) - self.verify_only[width - 1]

    @property
    def verify_only(self) -> tuple[float, ...]:
        """Per width, a round without the drafter pass (a prompt-lookup round)."""
        return self.verify_seconds or self.seconds

    @classmethod
    def uncalibrated(cls, max_width: int, slope: float = DEFAULT_COST_SLOPE) -> RoundCosts:
        return cls(tuple(1.0 + slope * (w - 1) for w in range(1, max_width + 1)))


def expected_committed(rates: Sequence[float], width: int) -> float:
    """E[tokens committed by a round of `width`]; rates[j-1] = a_j as in the module docstring."""
    survival = np.cumprod(np.asarray(rates[: width - 1], dtype=np.float64))
    return 1.0 + float(survival.sum())


def speeds_by_width(rates: Sequence[float], seconds: Sequence[float], limit: int) -> np.ndarray:
    """speeds[w-1] = E[committed | w] / seconds[w-1] for widths 1..limit, in one pass."""
    survival = np.concatenate([[1.0], np.cumprod(np.asarray(rates[: limit - 1], dtype=np.float64))])
    return np.cumsum(survival) / np.asarray(seconds[:limit])


def smoothed_rates(hits: Sequence[float], trials: Sequence[float],
                   prior: float = DEFAULT_PRIOR) -> list[float]:
    """a_j from counts (hits[j] of the trials[j] rounds that reached position j+1 kept it),
    with one pseudo-trial at `prior` so that a position seen rarely is not 0 or 1 outright."""
    return [(h + prior) / (t + 1.0) for h, t in zip(hits, trials)]
