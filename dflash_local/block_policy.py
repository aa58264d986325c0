"""Choosing the block width of each round: the width with the most expected tokens per second.

Pure logic on plain numbers; the loop (speculative.py) asks `choose` before each round and
reports the round with `observe`. Inputs: what one round costs at each width on this machine
(target verify + drafter pass, measured by dflash_local/calibration.py) and the acceptance seen
so far. With a_j = P(draft j accepted | drafts 1..j-1 accepted), a round of width w commits

    E[committed | w] = 1 + sum_{k=1..w-1} a_1 * a_2 * ... * a_k     (the bonus token included)

and the policy picks argmax_w E[committed | w] / cost(w). Width 1 is plain decoding. When no
width beats it, the policy falls back to plain and probes the best speculative width once every
`probe_every` plain rounds, doubling that interval (up to `max_probe_every`) after each probe
that keeps no draft, and never probing so often that the probes' extra cost exceeds
`probe_budget` of plain decoding: a useless drafter costs about 1% once it has lost.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SPECULATIVE = "speculative"
FALLBACK = "plain-fallback"
PROBE = "probe"  # one speculative round tried while falling back
LOOKUP = "lookup"  # a round that verifies a prompt-lookup draft (lookup.py) instead

# what a lookup draft's continuation rate starts from, by the length of the matched suffix: a
# 3-token match is more often a real copy than a 1-token one (design priors, then measured)
LOOKUP_PRIORS = {1: 0.4, 2: 0.6, 3: 0.8}

DEFAULT_PRIOR = 0.5  # per-position acceptance assumed without a calibration run
DEFAULT_COST_SLOPE = 0.06  # uncalibrated: each extra row costs 6% of a plain step (CPU, small B)


@dataclass(frozen=True)
class RoundCosts:
    """seconds[w - 1] = one round of width w: verify + commit, plus the drafter pass when w > 1.
    verify_seconds[w - 1] = the same without the drafter pass (a prompt-lookup round); unknown
    (None), a lookup round is priced like a drafter round, which only makes lookup rarer.

    Both were timed on `base_context` tokens of context. A verify reads the whole cache, and a
    wide one grows dearer with the context faster than a 1-row step (MLX on a CPU, the embedded
    pair's calibrations, calibration.LongContextTimer: 0.042 ms per token of context for a
    16-row verify, 0.010 for one row; 0.096 and 0.009 before trees ran as one sequence and
    before engines/mlx_attention.py): `context_slopes[w - 1]` is the
    seconds each token of context past `base_context` adds to a round of width w (`at_context`)."""

    seconds: tuple[float, ...]
    verify_seconds: tuple[float, ...] | None = None
    base_context: int = 0
    context_slopes: tuple[float, ...] | None = None

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
                          tuple(v + e for v, e in zip(self.verify_only, extra)), tokens)

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
    """One generation's width chooser. `choose` before a round, `observe` after it."""

    def __init__(self, costs: RoundCosts, prior: Sequence[float] = (), *, max_width: int | None = None,
                 rate: float = 0.1, drift: float = 0.005, probe_every: int = 16,
                 max_probe_every: int = 64, probe_budget: float = 0.01):
        self.calibrated = costs  # as timed; `costs` is what a round costs at the current context
        self.costs = costs
        # set by the loop when it drafts every drafter round at the widest width it may and
        # verifies a prefix (auto's tree rounds): a round then pays that whole drafter pass
        self.whole_block_drafts = False
        self.max_width = min(max_width or costs.max_width, costs.max_width)
        self.estimate = AcceptanceEstimate(_fit(prior, self.max_width - 1), rate, drift)
        self.mode = SPECULATIVE
        self.probe_every = probe_every
        self.max_probe_every = max_probe_every
        self.probe_budget = probe_budget
        self._interval = probe_every
        self._plain_rounds = 0
        self._probing = False

    def price_context(self, tokens: int) -> RoundCosts:
        """Price rounds at `tokens` of context from now on (RoundCosts.at_context); returns the
        costs, which the loop hands to the tree sizer and the lookup policy too."""
        self.costs = self.calibrated.at_context(tokens)
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

    def best_width(self, limit: int | None = None, min_width: int = 1) -> int:
        """argmax of expected tokens/s over widths min_width..limit (ties: the narrower)."""
        limit = min(limit or self.max_width, self.max_width)
        speed = speeds_by_width(self.estimate.rates(), self.round_seconds(limit), limit)
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
        probe_width = self.best_width(limit, min_width=2)
        seconds = self.round_seconds(limit)
        extra = seconds[probe_width - 1] / seconds[0] - 1.0  # a probe's cost over plain
        if self._plain_rounds < max(self._interval, extra / self.probe_budget):
            return Choice(1, FALLBACK)
        self._plain_rounds, self._probing = 0, True
        return Choice(probe_width, PROBE)

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


class CopyEstimate:
    """P(the next copied token is right | the ones before it were), one number for every
    position: a copy from the context goes on until it breaks, so one round that keeps 7 drafts
    says as much about position 8 as about position 2, and the width can grow in a round or two.
    Counts decay by `decay` every round of the generation, observed or not: the estimate follows
    a text that stops copying, and one that was written off is tried again some rounds later."""

    def __init__(self, prior: float, length: int, prior_weight: float = 2.0, decay: float = 0.95):
        self.prior, self.length, self.prior_weight, self.decay = prior, length, prior_weight, decay
        self.hits = self.trials = 0.0

    def forget(self) -> None:
        self.hits *= self.decay
        self.trials *= self.decay

    def observe(self, drafted: int, accepted: int) -> None:
        self.hits += accepted
        self.trials += min(accepted + 1, drafted)

    def rates(self) -> np.ndarray:
        rate = (self.hits + self.prior * self.prior_weight) / (self.trials + self.prior_weight)
        return np.full(self.length, rate)


class LookupPolicy:
    """Whether a round should verify a prompt-lookup draft, and how many of its tokens.

    Acceptance is tracked apart for each length of the matched suffix (a 3-token match predicts
    better than a 1-token one); a lookup round costs a verify without the drafter pass. The loop
    takes a lookup round when its expected tokens/s beats the block policy's best choice."""

    def __init__(self, costs: RoundCosts, max_ngram: int):
        self.costs = costs
        self.estimates = {n: CopyEstimate(LOOKUP_PRIORS[min(n, max(LOOKUP_PRIORS))], costs.max_width - 1)
                          for n in range(1, max_ngram + 1)}

    def next_round(self) -> None:
        for estimate in self.estimates.values():
            estimate.forget()

    def plan(self, ngram: int, draft_len: int, limit: int) -> tuple[int, float]:
        """(width, expected tokens/s) of the best lookup round: width - 1 <= draft_len drafts."""
        widest = max(1, min(limit, draft_len + 1, self.costs.max_width))
        speeds = speeds_by_width(self.estimates[ngram].rates(), self.costs.verify_only, widest)
        best = 1 + int(np.argmax(speeds))
        return best, float(speeds[best - 1])

    def observe(self, ngram: int, width: int, accepted: int) -> None:
        self.estimates[ngram].observe(width - 1, accepted)

    def survival(self, ngram: int, length: int) -> np.ndarray:
        """P(a draft's first j tokens are all right), j = 1..length, for this match length."""
        return np.cumprod(self.estimates[ngram].rates()[:length])


class TreeSizer:
    """How many of a draft tree's nodes to verify (draft_tree.py): the prefix, best first, with
    the most expected tokens per second.

    A node is kept with about its path's probability under the drafter, times `scale`: the
    ratio of drafts kept to drafts predicted so far in this generation (a drafter is rarely
    calibrated, and less so on text unlike its training data), which starts from 1 as if
    `prior_weight` drafts had been predicted and kept. The round's drafter pass is paid
    whatever the size, at the width it was drafted."""

    def __init__(self, costs: RoundCosts, prior_weight: float = 4.0):
        self.costs = costs
        self.prior_weight = prior_weight
        self.kept = self.predicted = 0.0

    @property
    def scale(self) -> float:
        return (self.kept + self.prior_weight) / (self.predicted + self.prior_weight)

    def size(self, path_probs: Sequence[float], drafted_width: int) -> int:
        """The number of nodes (>= 1) to verify; path_probs are non-increasing."""
        probs = np.minimum(1.0, self.scale * np.asarray(path_probs, dtype=np.float64))
        count = min(len(probs), self.costs.max_width - 1)
        draft_s = self.costs.draft_seconds(drafted_width)
        expected = 1.0 + np.cumsum(probs[:count])
        seconds = np.asarray(self.costs.verify_only[1 : count + 1]) + draft_s
        return 1 + int(np.argmax(expected / seconds))

    def graft_length(self, path_probs: Sequence[float], drafted_width: int,
                     chain_survival: Sequence[float], shared: int, taken: float = 0.0) -> int:
        """How many tokens of a prompt-lookup chain to graft onto a tree of these (sized) nodes
        (DraftTree.graft): the first `shared` are nodes already, each one after them is a row
        that pays its verify cost and brings its survival probability (the chance the copy is
        still right there). Where the chain leaves the tree, the drafter's own children of that
        node hold `taken` (their path probabilities over the node's, as the drafter says): the
        copy's token is another one, so it is right at most 1 - scale * taken of the time.
        The shared tokens count (verified anyway, they say how the copy goes); no more when no
        new row is expected to raise tokens per second."""
        probs = np.minimum(1.0, self.scale * np.asarray(path_probs, dtype=np.float64))
        room = self.costs.max_width - 1 - len(probs)  # never a width the calibration did not time
        new = np.asarray(chain_survival[shared : shared + max(0, room)], dtype=np.float64)
        if not len(new):
            return min(shared, len(chain_survival))
        before = chain_survival[shared - 1] if shared else 1.0
        step = new[0] / before if before > 0 else 0.0  # the copy's own chance at that token
        left = max(0.0, 1.0 - self.scale * taken)
        if step > left:
            new = new * (left / step)
        rows = len(probs) + np.arange(len(new) + 1)  # nodes verified with 0..len(new) grafted
        expected = 1.0 + probs.sum() + np.concatenate([[0.0], np.cumsum(new)])
        seconds = np.asarray(self.costs.verify_only)[rows] + self.costs.draft_seconds(drafted_width)
        return shared + int(np.argmax(expected / seconds))

    def observe(self, path_probs: Sequence[float], kept: int) -> None:
        """A tree whose nodes had these path probabilities kept `kept` drafts."""
        self.predicted += float(np.sum(path_probs))
        self.kept += kept


def _fit(prior: Sequence[float], length: int) -> list[float]:
    """The prior cut or padded (with its last value, or DEFAULT_PRIOR) to `length` positions."""
    values = [float(p) for p in prior[:length]]
    pad = values[-1] if values else DEFAULT_PRIOR
    return values + [pad] * (length - len(values))
