"""The auto planner: each round, the proposer and width with the most expected tokens per second.

It prices every kind of round from this machine's measured costs (calibration.py) at the
context the round runs on, as its part of the batch where `lanes` says others' rounds are
batched with it (RoundCosts.in_batch: a big batch wants narrower drafts, or none), and the
acceptance seen so far in this generation:
- a drafter round of the width `BlockPolicy` chooses (widths.py; width 1 is a plain step, and it
  falls back to plain while speculation would lose, probing now and then with a short chain);
- with trees, that round drafts all it may and verifies the prefix of the tree the `TreeSizer`
  expects to pay most (trees.py), a prompt-lookup draft grafted on where its rows pay;
- a prompt-lookup round (no drafter pass) when a lookup draft is expected to beat the
  drafter's best round (lookups.py).
It owns every estimator and hears each round once, in `observe`; with timed costs it also
hears what the round took, and re-prices rounds where those times disagree with the
calibration (observed.py). A calibration marked noisy is checked sooner: while too few rounds
were timed to compare it, a fallback to plain probes every UNCHECKED_PROBE_EVERY plain steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dflash_local.method.draft_tree import DraftTree
from dflash_local.method.lookup import DEFAULT_MAX_NGRAM, LookupDraft, NgramIndex
from dflash_local.method.planning.costs import RoundCosts
from dflash_local.method.planning.lookups import LookupPolicy
from dflash_local.method.planning.modes import FALLBACK, LOOKUP, PROBE, SPECULATIVE
from dflash_local.method.planning.observed import ObservedCosts, RoundTimes
from dflash_local.method.planning.trees import TreeSizer
from dflash_local.method.planning.widths import BlockPolicy
from dflash_local.method.proposers import (
    Draft,
    DrafterChain,
    DrafterTree,
    GraftedLookup,
    LookupChain,
    NoDraft,
    Proposer,
)

UNCHECKED_PROBE_EVERY = 4  # plain steps between probes while a noisy calibration is unchecked


class AutoPlanner:
    mode = SPECULATIVE

    def __init__(self, costs: RoundCosts, prior: Sequence[float], widest: int, trees: bool,
                 prompt_ids: list[int] | None = None, max_ngram: int = DEFAULT_MAX_NGRAM,
                 times: RoundTimes | None = None, lanes: Callable[[], int] | None = None):
        """`prompt_ids`: the text prompt lookup drafts from; None: no lookup rounds. `times`:
        the rounds earlier generations timed against these costs (observed.py). `lanes`: how
        many generations' rounds are batched now, this one's included (shared_rounds.py:
        RoundSharing.in_flight); None: it runs alone."""
        self.lanes = lanes
        self.policy = BlockPolicy(costs, prior, max_width=widest, whole_block_drafts=trees)
        self.sizer = TreeSizer(costs) if trees else None
        self.index = NgramIndex(prompt_ids, max_ngram) if prompt_ids is not None else None
        self.lookup = LookupPolicy(costs, max_ngram) if prompt_ids is not None else None
        calibrated = self.policy.calibrated
        self.observed = ObservedCosts(calibrated, times) if calibrated.timed else None
        if self.observed is not None:  # rounds timed before this generation may re-price it now
            self.policy.calibrated = self.observed.corrected()
        if self.observed is not None and not calibrated.reliable and not self.observed.compared():
            self.policy.sooner_probe_every = UNCHECKED_PROBE_EVERY
        self._context, self._lanes = 0, 1  # the planned round's
        # the planned round's drafter pass (its width; 1: none) and expected tokens, for `priced`
        self._planned: tuple[int, float | None] = (1, None)

    def plan(self, context: int, remaining: int) -> Proposer:
        self._price(context)
        if self.observed is not None and self.observed.wants_plain_step():
            self._planned = (1, 1.0)  # the plain step the timed rounds are compared with
            return NoDraft(FALLBACK)
        limit = max(1, min(self.policy.max_width, remaining))  # the widest round allowed now
        lookup = self._lookup_draft(limit)
        if lookup is not None:
            alone = self._lookup_alone(lookup, limit)
            if alone is not None:
                return LookupChain(alone)
        choice = self.policy.choose(remaining)
        if choice.width == 1:
            self._planned = (1, 1.0)  # a plain step commits its one token
            return NoDraft(choice.mode)
        if self.sizer is None or choice.mode == PROBE:  # a probe is a chain (BlockPolicy._probe)
            self._planned = (choice.width, self.policy.expected_tokens(choice.width))
            return DrafterChain(choice.width, choice.mode)
        self._planned = (limit, None)  # the tree sizer settles its size after the drafter pass
        tree = DrafterTree(limit - 1, choice.mode, size=lambda drafted: self.sizer.size(
            drafted.path_probs, limit))
        return tree if lookup is None else GraftedLookup(tree, lookup, self._graft_length)

    def observe(self, draft: Draft, path: list[int], committed: list[int],
                seconds: float | None = None) -> None:
        if seconds is not None and self.observed is not None:
            calibrated = self._price_of(draft, self.observed.calibrated.at_context(
                self._context).in_batch(self._lanes))
            self.observed.observe(not draft.tree.token_ids and not draft.drafter_nodes, seconds,
                                  calibrated)
            self.policy.calibrated = self.observed.corrected()
            if self.observed.compared():
                self.policy.sooner_probe_every = None
        if self.index is not None:
            self.index.extend(committed)
        if draft.mode == LOOKUP:
            self.lookup.observe(draft.lookup.ngram, len(draft.tree.token_ids) + 1, len(path))
            return
        if draft.grafted:
            self.lookup.observe(draft.lookup.ngram, len(draft.grafted) + 1,
                                common_start(draft.kept_ids(path), draft.grafted))
        if self.sizer is not None and draft.tree.path_probs:
            # a drafter round is judged on its own nodes: a lookup draft grafted on comes after them
            kept = draft.drafter_kept(path)
            self.sizer.observe(draft.tree.path_probs, kept)
            drafter_depth = max(draft.tree.depths[: draft.drafter_nodes + 1])  # grafted nodes after
            self.policy.observe(drafter_depth + 1, kept)
        else:  # a chain (a probe) by its depth: the positions a kept path could reach
            self.policy.observe(draft.tree.depth + 1, len(path))

    def priced(self, draft: Draft) -> tuple[float, float | None]:
        """(the seconds this round as it ran was priced at, at its context (calibrated, or as
        re-priced by observed.py); the tokens it was planned to commit, None where a tree's size
        was settled after planning)."""
        return self._price_of(draft, self.policy.costs), self._planned[1]

    def _price_of(self, draft: Draft, costs: RoundCosts) -> float:
        rows = min(len(draft.tree.token_ids) + 1, costs.max_width)
        drafted_width = self._planned[0]
        draft_s = costs.draft_seconds(drafted_width) if draft.drafter_nodes else 0.0
        return costs.verify_only[rows - 1] + draft_s

    def _price(self, context: int) -> None:
        """Every part that prices rounds prices them at the context the next round runs on, as
        its part of the batch it runs in."""
        self._context, self._lanes = context, self.lanes() if self.lanes is not None else 1
        costs = self.policy.price_context(context, self._lanes)
        if self.sizer is not None:
            self.sizer.costs = costs
        if self.lookup is not None:
            self.lookup.costs = costs

    def _lookup_draft(self, limit: int) -> LookupDraft | None:
        """This round's lookup draft, as long as the round may be; None without a match."""
        if self.index is None:
            return None
        self.lookup.next_round()
        return self.index.propose(limit - 1)

    def _lookup_alone(self, lookup: LookupDraft, limit: int) -> LookupDraft | None:
        """The lookup draft cut to its best width when a lookup round of its own is expected to beat
        the block policy's best choice; else None."""
        width, speed = self.lookup.plan(lookup.ngram, len(lookup.token_ids), limit)
        if width < 2 or speed <= self.policy.best_tokens_per_s(limit):
            return None
        self._planned = (1, speed * self.lookup.costs.verify_only[width - 1])
        return LookupDraft(lookup.token_ids[: width - 1], lookup.ngram)

    def _graft_length(self, tree: DraftTree, lookup: LookupDraft, drafted_width: int,
                      held: tuple[int, int]) -> int:
        node, shared = held
        survival = self.lookup.survival(lookup.ngram, min(len(lookup.token_ids), drafted_width - 1))
        return self.sizer.graft_length(tree.path_probs, drafted_width, survival, shared,
                                       taken=tree.children_mass(node))


def common_start(kept: list[int], chain: tuple[int, ...]) -> int:
    """How many of the chain's first tokens the round kept."""
    count = 0
    for token, wanted in zip(kept, chain):
        if token != wanted:
            break
        count += 1
    return count
