"""Choosing the width of each drafter round: the width with the most expected tokens per second.

Pure logic on plain numbers (costs.py has the arithmetic). The auto planner asks `choose` before
each round and reports the round with `observe`. Width 1 is plain decoding. When no width beats
it, the policy falls back to plain and probes (a drafter chain of the best width) once every
`probe_every` plain rounds, doubling that interval (up to `max_probe_every`) after each probe
that keeps no draft, and never probing so often that the probes' extra cost exceeds
`probe_budget` of plain decoding: a useless drafter costs about 1% once it has lost. While
`sooner_probe_every` is set (auto.py: a noisy calibration not yet checked against timed rounds,
whose price of a probe may be what made speculation look lost) it probes that often instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dflash_local.method.planning.costs import (
    DEFAULT_PRIOR,
    RoundCosts,
    expected_committed,
    speeds_by_width,
)
from dflash_local.method.planning.modes import FALLBACK, PROBE, SPECULATIVE


class AcceptanceEstimate:
    """Per-position conditional acceptance a_1..a_{B-1}, from the prior on, following the
    generation. A position a round reached moves toward what happened there (1 kept, 0 rejected)
    by 1/(n + prior_weight) at its n-th observation, a running mean that counts the prior as
    `prior_weight` rounds, and never by less than `rate` (after that, an exponential average
    that keeps following a generation whose text changes). Positions a round did not reach drift
    back to the prior by `drift`: a width that stopped being tried is tried again some day."""

    def __init__(self, prior: Sequence[float], rate: float = 0.1, drift: float = 0.005,
                 prior_weight: float = 2.0):
        self.prior = np.clip(np.asarray(prior, dtype=np.float64), 0.0, 1.0)
        self.values = self.prior.copy()
        self.seen = np.zeros_like(self.prior)
        self.rate, self.drift, self.prior_weight = rate, drift, prior_weight

    def observe(self, drafted: int, accepted: int) -> None:
        """A round drafted `drafted` tokens and the target accepted the first `accepted`."""
        assert 0 <= accepted <= drafted <= len(self.values), (accepted, drafted, len(self.values))
        reached = min(accepted + 1, drafted)  # the accepted positions and the first rejection
        outcome = np.zeros(reached)
        outcome[:accepted] = 1.0
        self.seen[:reached] += 1.0
        step = np.maximum(self.rate, 1.0 / (self.seen[:reached] + self.prior_weight))
        self.values[:reached] += step * (outcome - self.values[:reached])
        self.values[reached:] += self.drift * (self.prior[reached:] - self.values[reached:])

    def rates(self) -> np.ndarray:
        return self.values


@dataclass(frozen=True)
class Choice:
    width: int
    mode: str  # SPECULATIVE, FALLBACK or PROBE


class BlockPolicy:
    """One generation's width chooser. `choose` before a round, `observe` after it.

    `whole_block_drafts`: every drafter round drafts the widest width it may and verifies a
    prefix (auto's tree rounds), so a round pays that whole drafter pass whatever its width."""

    def __init__(self, costs: RoundCosts, prior: Sequence[float] = (), *, max_width: int | None = None,
                 rate: float = 0.1, drift: float = 0.005, probe_every: int = 16,
                 max_probe_every: int = 64, probe_budget: float = 0.01,
                 whole_block_drafts: bool = False):
        self.calibrated = costs  # as timed; `costs` is what a round costs at the current context
        self.costs = costs
        self.whole_block_drafts = whole_block_drafts
        self.max_width = min(max_width or costs.max_width, costs.max_width)
        self.estimate = AcceptanceEstimate(_fit(prior, self.max_width - 1), rate, drift)
        self.mode = SPECULATIVE
        self.probe_every = probe_every
        self.max_probe_every = max_probe_every
        self.probe_budget = probe_budget
        self._interval = probe_every
        self._plain_rounds = 0
        self._probing = False
        self.sooner_probe_every: int | None = None

    def price_context(self, tokens: int, lanes: int = 1) -> RoundCosts:
        """Price rounds at `tokens` of context from now on (RoundCosts.at_context), as one of
        `lanes` lanes whose rounds are batched (RoundCosts.in_batch); returns the costs, which
        the auto planner hands to its tree sizer and lookup policy too."""
        self.costs = self.calibrated.at_context(tokens).in_batch(lanes)
        return self.costs

    def round_seconds(self, limit: int) -> tuple[float, ...]:
        """What a round of each width 1..limit costs. With whole-block drafts the drafter pass
        is the one at width `limit` (the widest the round may draft), whatever is verified."""
        if not self.whole_block_drafts or limit < 2:
            return self.costs.seconds[:limit]
        draft = self.costs.draft_seconds(limit)
        return (self.costs.at(1), *(verify + draft for verify in self.costs.verify_only[1:limit]))

    def best_tokens_per_s(self, limit: int | None = None) -> float:
        """What the best round this policy can choose now is expected to make per second."""
        limit = min(limit or self.max_width, self.max_width)
        return float(np.max(speeds_by_width(self.estimate.rates(), self.round_seconds(limit), limit)))

    def expected_tokens(self, width: int) -> float:
        """What a drafter round of `width` is expected to commit (the bonus token included)."""
        return expected_committed(self.estimate.rates(), width)

    def best_width(self, limit: int | None = None, min_width: int = 1,
                   seconds: tuple[float, ...] | None = None) -> int:
        """argmax of expected tokens/s over widths min_width..limit (ties: the narrower), each
        width priced at `seconds` (None: round_seconds)."""
        limit = min(limit or self.max_width, self.max_width)
        seconds = self.round_seconds(limit) if seconds is None else seconds
        speed = speeds_by_width(self.estimate.rates(), seconds, limit)
        return min_width + int(np.argmax(speed[min_width - 1 :]))

    def choose(self, remaining: int) -> Choice:
        """The width of the next round; never more than the `remaining` tokens allowed."""
        limit = max(1, min(self.max_width, remaining))
        if limit == 1:  # the last token: one plain step, whatever the mode
            return Choice(1, self.mode)
        best = self.best_width(limit)
        if best > 1:
            self.mode, self._interval, self._plain_rounds = SPECULATIVE, self.probe_every, 0
            return Choice(best, SPECULATIVE)
        self.mode = FALLBACK
        self._plain_rounds += 1
        probe_width, extra = self._probe(limit)
        if self._plain_rounds < self._probe_after(extra):
            return Choice(1, FALLBACK)
        self._plain_rounds, self._probing = 0, True
        return Choice(probe_width, PROBE)

    def _probe_after(self, extra: float) -> float:
        """Plain rounds before the next probe, whose cost over a plain step is `extra`."""
        if self.sooner_probe_every is not None:
            return self.sooner_probe_every
        return max(self._interval, extra / self.probe_budget)

    def _probe(self, limit: int) -> tuple[int, float]:
        """(width, its cost over a plain step) of a probe: the drafter's chain of the width
        priced best, never a whole block's tree (it only asks whether the drafter is back; a
        tree sized after drafting could verify many more rows than its budget priced)."""
        seconds = self.costs.seconds[:limit]
        width = self.best_width(limit, min_width=2, seconds=seconds)
        return width, seconds[width - 1] / seconds[0] - 1.0

    def observe(self, width: int, accepted: int) -> None:
        """The round of `width` kept `accepted` of its width-1 drafts (the bonus not counted)."""
        if width > 1:
            self.estimate.observe(width - 1, accepted)
        if self._probing:  # a probe that kept nothing: the next one comes twice as late
            self._probing = False
            self._interval = (min(self._interval * 2, self.max_probe_every) if accepted == 0
                              else self.probe_every)

    def rates(self) -> list[float]:
        return [float(r) for r in self.estimate.rates()]


def _fit(prior: Sequence[float], length: int) -> list[float]:
    """The prior cut or padded (with its last value, or DEFAULT_PRIOR) to `length` positions."""
    values = [float(p) for p in prior[:length]]
    pad = values[-1] if values else DEFAULT_PRIOR
    return values + [pad] * (length - len(values))
