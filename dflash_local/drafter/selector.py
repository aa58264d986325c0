"""DFlash 2's candidate selector, on numpy: each block position's draft among its top-K.

The drafter scores every block position in one pass; DFlash 2 then picks, left to right, one of
each position's K best tokens by

    score(c | prev) = logit(c) + < predecessor_codebook[prev] * hidden_projection(h_pos),
                                   successor_codebook[c] >

where `prev` is the token picked at the position before (the anchor first). Greedy drafting is
the argmax at each position (`greedy_chain`, z-lab's rule). A tree (`selector_tree`) keeps the
most probable paths, a child's probability being softmax(score) over its position's K given its
parent's token: the selector prices paths as it picks them. The engines gather the few codebook
rows a round needs in their framework (`SelectorInputs`); this module holds the rule once.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from dflash_local.method.draft_tree import DraftTree


@dataclass(frozen=True)
class SelectorInputs:
    """One round's selector inputs for D block positions after the anchor, K candidates each."""

    unary: np.ndarray  # [D, K] the drafter's (shaped) logits of the candidates
    candidates: np.ndarray  # [D, K] their token ids
    hidden: np.ndarray  # [D, r] hidden_projection of each position's hidden state
    anchor_code: np.ndarray  # [r] predecessor_codebook[anchor]
    predecessor: np.ndarray  # [D, K, r] predecessor_codebook of each candidate
    successor: np.ndarray  # [D, K, r] successor_codebook of each candidate

    def scores(self, depth: int, predecessor_code: np.ndarray) -> np.ndarray:
        """[K]: the candidates' scores at `depth` after a token with this predecessor code."""
        return self.unary[depth] + self.successor[depth] @ (predecessor_code * self.hidden[depth])


def greedy_chain(inputs: SelectorInputs) -> list[int]:
    """The argmax at each position, given the pick before it."""
    code, drafts = inputs.anchor_code, []
    for depth in range(len(inputs.unary)):
        rank = int(np.argmax(inputs.scores(depth, code)))
        drafts.append(int(inputs.candidates[depth, rank]))
        code = inputs.predecessor[depth, rank]
    return drafts


def selector_tree(inputs: SelectorInputs, nodes: int) -> DraftTree:
    """The `nodes` most probable paths, best first (every parent before its children)."""
    heap: list = []  # (minus log-probability of the path, order, parent node, depth, rank)
    order = 0

    def push_children(node: int, depth: int, code: np.ndarray, log_prob: float) -> None:
        nonlocal order
        if depth >= len(inputs.unary):
            return
        scores = inputs.scores(depth, code).astype(np.float64)
        log_probs = scores - scores.max() - np.log(np.exp(scores - scores.max()).sum())
        for rank in range(scores.shape[0]):
            heapq.heappush(heap, (-(log_prob + log_probs[rank]), order, node, depth, rank))
            order += 1

    push_children(0, 0, inputs.anchor_code, 0.0)
    token_ids: list[int] = []
    parents: list[int] = []
    path_probs: list[float] = []
    while heap and len(token_ids) < nodes:
        cost, _, parent, depth, rank = heapq.heappop(heap)
        token_ids.append(int(inputs.candidates[depth, rank]))
        parents.append(parent)
        path_probs.append(float(np.exp(-cost)))
        push_children(len(token_ids), depth + 1, inputs.predecessor[depth, rank], -cost)
    return DraftTree(tuple(token_ids), tuple(parents), tuple(path_probs))
