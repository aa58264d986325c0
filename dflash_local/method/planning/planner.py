"""The planner protocol, `make_planner`, and the round shapes calibration times.

A planner is asked `plan(context, remaining)` before each round and told the round's outcome
once, in `observe`; it owns whatever it estimates. `FixedPlanner` drafts one width every round
(width 1: plain decoding); `AutoPlanner` prices every kind of round from this machine's
measured costs. `timed_rounds` says which rounds calibration.py must time for them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from dflash_local.events import Auto, GenerationParams
from dflash_local.method.draft_tree import DraftTree
from dflash_local.method.planning.auto import AutoPlanner
from dflash_local.method.planning.costs import RoundCosts
from dflash_local.method.planning.fixed import FixedPlanner, is_tree_round
from dflash_local.method.planning.observed import RoundTimes
from dflash_local.method.proposers import Draft, Proposer


class Planner(Protocol):
    mode: str  # the kind of round it starts with (modes.py): what the prefill's event reports

    def plan(self, context: int, remaining: int) -> Proposer:
        """The next round's proposer: `context` tokens so far, at most `remaining` to commit."""

    def observe(self, draft: Draft, path: list[int], committed: list[int],
                seconds: float | None = None) -> None:
        """The round verified `draft`, kept the nodes of `path` and committed these tokens;
        `seconds`: what it took from its proposal to its commit, where the loop timed it."""

    def priced(self, draft: Draft) -> tuple[float | None, float | None]:
        """(seconds, tokens): what the planner expected the round it planned, which ran as
        `draft`, to cost and to commit (None: it does not price rounds). For a trace."""


def make_planner(params: GenerationParams, widest: int, trees: bool, prompt_ids: list[int],
                 costs: RoundCosts | None = None, prior: Sequence[float] = (),
                 times: RoundTimes | None = None, lanes: Callable[[], int] | None = None) -> Planner:
    """The planner params ask for. `widest`: events.widest_block; `trees`: whether the runner
    and the request allow tree rounds; `costs`/`prior`: the engine's calibration (None: the
    uncalibrated defaults); `times`: the rounds its earlier generations timed (observed.py);
    `lanes`: how many generations' rounds are batched now (None: alone)."""
    if widest == 1 or not isinstance(params.block_size, Auto):
        return FixedPlanner(widest, trees and widest > 2)
    return AutoPlanner(costs or RoundCosts.uncalibrated(widest), prior, widest,
                       trees and widest > 2, list(prompt_ids) if params.prompt_lookup else None,
                       times=times, lanes=lanes)


@dataclass(frozen=True)
class RoundShape:
    """One kind of round the planners run, as calibration times it: its width and whether its
    draft is a tree (the drafter's tree pass and the runner's tree verify) or a chain."""

    width: int
    tree: bool

    def filler_draft(self, filler: Sequence[int]) -> DraftTree:
        """A draft of this shape from any tokens: a tree of width - 1 nodes that forks at the
        anchor (so it takes the tree verify), or a chain."""
        nodes = [int(t) for t in filler[: self.width - 1]]
        if not self.tree:
            return DraftTree.chain(nodes)
        return DraftTree(tuple(nodes), (0, *range(1, len(nodes) - 1), 0)[: len(nodes)])


def timed_rounds(block: int, trees: bool) -> list[RoundShape]:
    """The rounds of each width 1..block: at a fixed width a round verifies a tree where
    is_tree_round says so; auto's tree rounds draft the whole block and verify a prefix, which
    widths.BlockPolicy prices from these timings."""
    return [RoundShape(width, is_tree_round(width, trees)) for width in range(1, block + 1)]
