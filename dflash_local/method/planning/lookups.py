"""Pricing prompt-lookup drafts (lookup.py): whether a round should verify one, and how much of it.

A lookup draft goes on until the text stops repeating, so its acceptance is one number per
match length (`LookupEstimate`), not one per position as a drafter's. Whether the text repeats
at all is shared by every match length: a reply that repeats nothing (most chat) pulls every
length's prior down (never up), so a failing lookup draft at one length is not tried again at
each of the others.
"""

from __future__ import annotations

import numpy as np

from dflash_local.method.planning.costs import RoundCosts, speeds_by_width

# what a lookup draft's continuation rate starts from, by the length of the matched suffix: a
# 3-token match more often continues as before than a 1-token one (design priors, then measured)
LOOKUP_PRIORS = {1: 0.4, 2: 0.6, 3: 0.8}
POOLED_WEIGHT = 2.0  # pseudo-rounds of "repeats as the priors say" behind the shared factor
POOLED_DECAY = 0.99  # slower than one length's: whether a text repeats is a slower fact


class LookupEstimate:
    """P(the next lookup token is right | the ones before it were), one number for every
    position: a lookup draft goes on until the text stops repeating, so one round that keeps 7 drafts
    says as much about position 8 as about position 2, and the width can grow in a round or two.
    Counts decay by `decay` every round of the generation, observed or not: the estimate follows
    a text that stops repeating, and one that was written off is tried again some rounds later."""

    def __init__(self, prior: float, length: int, prior_weight: float = 2.0, decay: float = 0.95):
        self.prior, self.length, self.prior_weight, self.decay = prior, length, prior_weight, decay
        self.hits = self.trials = 0.0

    def forget(self) -> None:
        self.hits *= self.decay
        self.trials *= self.decay

    def observe(self, drafted: int, accepted: int) -> None:
        self.hits += accepted
        self.trials += min(accepted + 1, drafted)

    def rates(self, prior_scale: float = 1.0) -> np.ndarray:
        """`prior_scale`: how much better or worse than the priors this text repeats so far."""
        prior = min(1.0, self.prior * prior_scale)
        rate = (self.hits + prior * self.prior_weight) / (self.trials + self.prior_weight)
        return np.full(self.length, rate)


class LookupPolicy:
    """Whether a round should verify a prompt-lookup draft, and how many of its tokens.

    Acceptance is tracked apart for each length of the matched suffix (a 3-token match predicts
    better than a 1-token one); a lookup round costs a verify without the drafter pass. The auto
    planner takes a lookup round when its expected tokens/s beats the block policy's best choice."""

    def __init__(self, costs: RoundCosts, max_ngram: int):
        self.costs = costs
        self.estimates = {n: LookupEstimate(LOOKUP_PRIORS[min(n, max(LOOKUP_PRIORS))], costs.max_width - 1)
                          for n in range(1, max_ngram + 1)}
        # lookup tokens kept, and those the priors expected, over every match length (decayed)
        self.pooled_hits = self.pooled_expected = 0.0

    def next_round(self) -> None:
        for estimate in self.estimates.values():
            estimate.forget()
        self.pooled_hits *= POOLED_DECAY
        self.pooled_expected *= POOLED_DECAY

    def prior_scale(self) -> float:
        """Kept lookup tokens over what the priors expected of the same rounds, at most 1 (and 1
        at the start): it only lowers the priors; a length's own counts say when it does better."""
        return min(1.0, (self.pooled_hits + POOLED_WEIGHT) / (self.pooled_expected + POOLED_WEIGHT))

    def plan(self, ngram: int, draft_len: int, limit: int) -> tuple[int, float]:
        """(width, expected tokens/s) of the best lookup round: width - 1 <= draft_len drafts."""
        widest = max(1, min(limit, draft_len + 1, self.costs.max_width))
        speeds = speeds_by_width(self.estimates[ngram].rates(self.prior_scale()), self.costs.verify_only,
                                 widest)
        best = 1 + int(np.argmax(speeds))
        return best, float(speeds[best - 1])

    def observe(self, ngram: int, width: int, accepted: int) -> None:
        estimate = self.estimates[ngram]
        estimate.observe(width - 1, accepted)
        self.pooled_hits += accepted
        self.pooled_expected += estimate.prior * min(accepted + 1, width - 1)

    def survival(self, ngram: int, length: int) -> np.ndarray:
        """P(a draft's first j tokens are all right), j = 1..length, for this match length."""
        return np.cumprod(self.estimates[ngram].rates(self.prior_scale())[:length])
