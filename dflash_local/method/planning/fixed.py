"""The fixed planner: every round drafts the same width (N = 1: plain decoding, the baseline)."""

from __future__ import annotations

from dflash_local.method.planning.modes import PLAIN, SPECULATIVE
from dflash_local.method.proposers import Draft, DrafterChain, DrafterTree, NoDraft, Proposer


def is_tree_round(width: int, trees: bool) -> bool:
    """Whether a fixed round of this width verifies a tree: one of a single node is the chain."""
    return trees and width > 2


class FixedPlanner:
    def __init__(self, width: int, trees: bool):
        self.width, self.trees = width, trees
        self.mode = SPECULATIVE if width > 1 else PLAIN

    def plan(self, context: int, remaining: int) -> Proposer:
        width = max(1, min(self.width, remaining))  # a round commits at most `width` tokens
        if width == 1:
            return NoDraft(self.mode)
        if is_tree_round(width, self.trees):
            return DrafterTree(width - 1)
        return DrafterChain(width)

    def observe(self, draft: Draft, path: list[int], committed: list[int],
                seconds: float | None = None) -> None:
        """A fixed planner learns nothing."""

    def priced(self, draft: Draft) -> tuple[None, None]:
        """A fixed planner prices nothing."""
        return None, None
