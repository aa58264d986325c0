"""Where a round's draft comes from: the proposers, each of which makes a DraftTree.

A planner (planning/) chooses one proposer per round; the loop (speculative.py) runs it and
verifies what it made. Every draft is a tree (draft_tree.py): a chain is a tree of one path,
plain decoding the empty tree. The sources a proposer draws on live in `DraftSources`: the
drafter, fed the taps of every committed row (they wait for its next pass), and nothing else:
a prompt-lookup draft arrives already made (the planner read it from the lookup index to
price it). A new kind of drafter is a new proposer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from dflash_local.method.draft_tree import DraftTree
from dflash_local.method.lookup import LookupDraft
from dflash_local.method.planning.modes import LOOKUP, SPECULATIVE

if TYPE_CHECKING:
    from dflash_local.method.interfaces import Drafter, TargetRunner


@dataclass(frozen=True)
class Draft:
    """A round's draft and who proposed it: nodes 1..drafter_nodes are the drafter's, the nodes
    after them a prompt-lookup draft's (`lookup`); `grafted` is the lookup chain where it rides
    along in a drafter tree (the tokens the tree already held included)."""

    tree: DraftTree
    mode: str
    drafter_nodes: int = 0
    lookup: LookupDraft | None = None
    grafted: tuple[int, ...] = ()

    def kept_ids(self, path: list[int]) -> list[int]:
        """The tokens of the kept path's nodes."""
        return [self.tree.token_ids[node - 1] for node in path]

    def drafter_kept(self, path: list[int]) -> int:
        """How many of the kept path's nodes are the drafter's (they come first on a path)."""
        return sum(node <= self.drafter_nodes for node in path)


class DraftSources:
    """The drafter of one generation, with the taps of the rows it has not seen yet."""

    def __init__(self, drafter: Drafter | None, runner: TargetRunner, unseen_taps: Any = None):
        """`unseen_taps`: a kept prefix's rows (prefix_cache.py) the drafter has not read yet."""
        self.drafter = drafter
        self._join = runner.join_taps
        self._pending: list[Any] = []
        if unseen_taps is not None:
            self.add_taps(unseen_taps)

    def add_taps(self, taps: Any) -> None:
        """The committed rows' taps: the drafter reads them with its next block."""
        if self.drafter is not None:
            self._pending.append(taps)

    def _taps(self) -> Any:
        taps = self._pending[0] if len(self._pending) == 1 else self._join(self._pending)
        self._pending = []
        return taps

    def unseen(self) -> Any:
        """The taps the drafter has not read yet, joined (None: none), handed over: a kept
        prefix (prefix_cache.py) gives them to the next generation's drafter."""
        return self._taps() if self._pending else None

    def chain(self, anchor_id: int, width: int) -> list[int]:
        return self.drafter.propose(anchor_id, self._taps(), width)

    def tree(self, anchor_id: int, nodes: int) -> DraftTree:
        return self.drafter.propose_tree(anchor_id, self._taps(), nodes)


class Proposer(Protocol):
    def propose(self, sources: DraftSources, anchor_id: int) -> Draft: ...


@dataclass(frozen=True)
class NoDraft:
    """A plain step: the anchor alone is verified."""

    mode: str

    def propose(self, sources: DraftSources, anchor_id: int) -> Draft:
        return Draft(DraftTree.chain(()), self.mode)


@dataclass(frozen=True)
class DrafterChain:
    """The drafter's argmax at each of the block's `width` - 1 positions."""

    width: int
    mode: str = SPECULATIVE

    def propose(self, sources: DraftSources, anchor_id: int) -> Draft:
        tree = DraftTree.chain(sources.chain(anchor_id, self.width))
        return Draft(tree, self.mode, drafter_nodes=len(tree.token_ids))


@dataclass(frozen=True)
class DrafterTree:
    """The drafter's `nodes` most probable paths; `size` (the auto planner's tree sizer) says how
    many of them, best first, are worth verifying (None: all)."""

    nodes: int
    mode: str = SPECULATIVE
    size: Callable[[DraftTree], int] | None = None

    def propose(self, sources: DraftSources, anchor_id: int) -> Draft:
        tree = sources.tree(anchor_id, self.nodes)
        if self.size is not None:
            tree = tree.prefix(self.size(tree))
        return Draft(tree, self.mode, drafter_nodes=len(tree.token_ids))


@dataclass(frozen=True)
class LookupChain:
    """A prompt-lookup draft verified alone: no drafter pass."""

    lookup: LookupDraft

    def propose(self, sources: DraftSources, anchor_id: int) -> Draft:
        return Draft(DraftTree.chain(self.lookup.token_ids), LOOKUP, lookup=self.lookup)


@dataclass(frozen=True)
class GraftedLookup:
    """A drafter tree with a lookup draft grafted on as one more path (DraftTree.graft);
    `length(tree, lookup, drafted_width, held)` says how many of the lookup draft's tokens pay
    their rows (`held`: DraftTree.held of the lookup chain)."""

    tree: DrafterTree
    lookup: LookupDraft
    length: Callable[[DraftTree, LookupDraft, int, tuple[int, int]], int]

    def propose(self, sources: DraftSources, anchor_id: int) -> Draft:
        draft = self.tree.propose(sources, anchor_id)
        chain = self.lookup.token_ids[: self.tree.nodes]
        node, shared = draft.tree.held(chain)
        length = self.length(draft.tree, self.lookup, self.tree.nodes + 1, (node, shared))
        tree = draft.tree.graft(chain[:length], (node, min(shared, length)))
        return replace(draft, tree=tree, lookup=self.lookup, grafted=chain[:length])
