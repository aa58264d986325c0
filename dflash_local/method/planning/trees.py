"""Sizing a drafter's tree (draft_tree.py) and grafting a lookup draft onto it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dflash_local.method.planning.costs import RoundCosts


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
        that pays its verify cost and brings its survival probability (the chance the lookup
        draft is still right there). Where the chain leaves the tree, the drafter's own children of that
        node hold `taken` (their path probabilities over the node's, as the drafter says): the
        lookup draft's token is another one, so it is right at most 1 - scale * taken of the time.
        The shared tokens count (verified anyway, they say how the lookup draft goes); no more when no
        new row is expected to raise tokens per second."""
        probs = np.minimum(1.0, self.scale * np.asarray(path_probs, dtype=np.float64))
        room = self.costs.max_width - 1 - len(probs)  # never a width the calibration did not time
        new = np.asarray(chain_survival[shared : shared + max(0, room)], dtype=np.float64)
        if not len(new):
            return min(shared, len(chain_survival))
        before = chain_survival[shared - 1] if shared else 1.0
        step = new[0] / before if before > 0 else 0.0  # the lookup draft's own chance at that token
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
