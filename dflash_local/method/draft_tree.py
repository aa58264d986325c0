"""Tree drafts: several candidate continuations verified in one target pass.

A DFlash drafter scores every block position in one pass, and each position's distribution does
not depend on the tokens drafted before it. A chain keeps the top token at each position; a tree
with the same number of rows spends them where the drafter is unsure: its nodes are the most
probable paths through the top-k tokens of the positions (a path's probability is the product of
the drafter's probabilities along it), best first, so every node's parent comes before it.

The target runs the anchor and the nodes in one pass, each node at the position of its depth and
seeing only the context, the anchor and its own ancestors (`ancestor_mask`). The target keeps the
longest path whose every token is its own greedy choice after the tokens before it, plus one
token of its own (`walk`): exactly what it would have produced alone. Sampling walks the tree
by acceptance.sampled_walk, which keeps every token a draw from the target's distribution.
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass

import numpy as np

TOP_K = 4  # candidates per position: beyond the 4th the drafter's hits are too rare to pay a row


@dataclass(frozen=True)
class DraftTree:
    """Nodes 1..N below the anchor (node 0, the token the round starts from)."""

    token_ids: tuple[int, ...]  # node i's token is token_ids[i - 1]
    parents: tuple[int, ...]  # node i's parent is parents[i - 1] (< i; 0 = the anchor)
    path_probs: tuple[float, ...] = ()  # the drafter's probability of node i's path (built trees)

    @classmethod
    def chain(cls, token_ids) -> DraftTree:
        return cls(tuple(int(t) for t in token_ids), tuple(range(len(token_ids))))

    @property
    def is_chain(self) -> bool:
        """One path from the anchor (no node has two children): a causal verify suffices."""
        return all(parent == node for node, parent in enumerate(self.parents))

    def prefix(self, nodes: int) -> DraftTree:
        """The first `nodes` nodes: a tree again (every parent comes before its children)."""
        return DraftTree(self.token_ids[:nodes], self.parents[:nodes], self.path_probs[:nodes])

    def held(self, chain) -> tuple[int, int]:
        """(the node at the end, how many tokens) of the longest start of `chain` that is a path
        of this tree from the anchor."""
        node = shared = 0
        for token in chain:
            child = self.child_with(node, token)
            if child is None:
                break
            node, shared = child, shared + 1
        return node, shared

    def graft(self, chain, held: tuple[int, int] | None = None) -> DraftTree:
        """This tree with `chain` as a path from the anchor (a prompt-lookup draft, lookup.py):
        it follows the nodes that already hold its tokens and goes on in new nodes, appended
        (path probability 0: the drafter did not propose them). `held`: `self.held(chain)`,
        where the caller has it. A new node's token is never one of its siblings' (held
        follows any child that has it), as sampled acceptance needs (acceptance.py)."""
        node, shared = held or self.held(chain)
        new = tuple(int(t) for t in chain[shared:])
        if not new:
            return self
        first = len(self.token_ids) + 1
        parents = (node, *range(first, first + len(new) - 1))
        probs = self.path_probs + (0.0,) * len(new) if self.path_probs else ()
        return DraftTree(self.token_ids + new, self.parents + parents, probs)

    def children_mass(self, node: int) -> float:
        """The drafter's probability of going on from `node` to one of its children (their
        path probabilities over the node's; the anchor's is 1). 0 without path probabilities."""
        if not self.path_probs:
            return 0.0
        own = self.path_probs[node - 1] if node else 1.0
        return sum(self.path_probs[child - 1] for _, child in self.children_of(node)) / own if own > 0 else 0.0

    @functools.cached_property
    def depths(self) -> tuple[int, ...]:
        """Depth of every row, the anchor's (0) included: its position after the anchor."""
        depths = [0]
        for parent in self.parents:
            depths.append(depths[parent] + 1)
        return tuple(depths)

    @property
    def depth(self) -> int:
        """The longest path: at most this many drafts can be kept."""
        return max(self.depths)

    def ancestor_mask(self) -> np.ndarray:
        """[N+1, N+1] bool: row i may attend to row j (j is i or an ancestor of i)."""
        size = len(self.token_ids) + 1
        mask = np.eye(size, dtype=bool)
        for node, parent in enumerate(self.parents, start=1):
            mask[node] |= mask[parent]
        return mask

    @functools.cached_property
    def _children(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        children: list[list[tuple[int, int]]] = [[] for _ in range(len(self.token_ids) + 1)]
        for node, (parent, token) in enumerate(zip(self.parents, self.token_ids), start=1):
            children[parent].append((token, node))
        return tuple(tuple(pairs) for pairs in children)

    def children_of(self, node: int) -> tuple[tuple[int, int], ...]:
        """(token, child node) of each child of `node`, in node order."""
        return self._children[node]

    def child_with(self, node: int, token: int) -> int | None:
        """The child of `node` that holds `token`, if any (siblings hold distinct tokens)."""
        return next((child for held, child in self._children[node] if held == token), None)

    def walk(self, target_choice: np.ndarray) -> tuple[list[int], int]:
        """Greedy acceptance. target_choice[i] = the target's argmax after row i.

        Returns (the kept path's nodes, in order; the target's token after the last of them).
        """
        path, node = [], 0
        while True:
            wanted = int(target_choice[node])
            child = self.child_with(node, wanted)
            if child is None:
                return path, wanted
            path.append(child)
            node = child


def build_tree(top_ids: np.ndarray, top_logprobs: np.ndarray, nodes: int) -> DraftTree:
    """The `nodes` most probable paths, best first.

    top_ids / top_logprobs: [D, K], the drafter's K best tokens at each of D positions after the
    anchor (best first) and their log-probabilities.
    """
    depth_limit, k = top_ids.shape
    # (minus log-probability of the path, tie-breaking order, parent node, depth, rank)
    heap = [(-float(top_logprobs[0, rank]), rank, 0, 0, rank) for rank in range(k)]
    heapq.heapify(heap)
    token_ids: list[int] = []
    parents: list[int] = []
    path_probs: list[float] = []
    pushed = k
    while heap and len(token_ids) < nodes:
        cost, _, parent, depth, rank = heapq.heappop(heap)
        token_ids.append(int(top_ids[depth, rank]))
        parents.append(parent)
        path_probs.append(float(np.exp(-cost)))
        node = len(token_ids)
        if depth + 1 < depth_limit:
            for child_rank in range(k):
                child_cost = cost - float(top_logprobs[depth + 1, child_rank])
                heapq.heappush(heap, (child_cost, pushed, node, depth + 1, child_rank))
                pushed += 1
    return DraftTree(tuple(token_ids), tuple(parents), tuple(path_probs))


def tree_from_logits(logits: np.ndarray, vocab_ids: np.ndarray | None, nodes: int,
                     top_k: int = TOP_K) -> DraftTree:
    """A tree of `nodes` drafts from the drafter's logits [D, V'] over positions 1..D.

    vocab_ids maps a column to its token id (a restricted draft vocabulary); None: column = id.
    """
    logits = np.asarray(logits, dtype=np.float32)
    top_k = min(top_k, logits.shape[1])
    rows = np.arange(len(logits))
    # k argmax passes, best first: ~20x cheaper than argpartition + sort on this hot path
    columns = np.empty((len(logits), top_k), dtype=np.int64)
    work = logits.copy()
    for rank in range(top_k):
        columns[:, rank] = work.argmax(axis=1)
        work[rows, columns[:, rank]] = -np.inf
    top = logits[rows[:, None], columns]
    peak = top[:, :1]
    log_norm = peak + np.log(np.exp(logits - peak).sum(axis=1, keepdims=True, dtype=np.float64))
    ids = columns if vocab_ids is None else np.asarray(vocab_ids)[columns]
    return build_tree(ids, top - log_norm, nodes)
