"""Pure acceptance rules of the speculative loop, on numpy arrays; a round's drafts are a
DraftTree (draft_tree.py), a chain being the tree with one child per node.

Greedy (DraftTree.walk): keep the longest path whose every token is the target's argmax, then
the target's own token. Sampling with an argmax proposal (one-hot q): for draft token d at row j,

    accept with probability min(1, p(d) / q(d)) = p(d)            (q(d) = 1)
    on rejection sample from norm(max(0, p - q)) = p without d, renormalised
    if every draft is accepted, the bonus comes from p at the last row.

This is exact rejection sampling: the output distribution is the target's own. A draft tree
(draft_tree.py) generalises it (`sampled_walk`): at a node whose children carry the distinct
tokens c_1..c_m, go to child c_i with probability p(c_i), else stop with a token from p without
c_1..c_m, renormalised. Every emitted token is then drawn from the target's p after the tokens
before it (a draw from p, kept as a child where it is one), and for one child it is the rule
above, random draws included.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dflash_local.events import GenerationParams
from dflash_local.method.draft_tree import DraftTree


def target_probs(logits: np.ndarray, params: GenerationParams) -> np.ndarray:
    """logits: [rows, V] -> probabilities after temperature, top-k and top-p, [rows, V] float64."""
    scaled = logits.astype(np.float64) / params.temperature
    if params.top_k and params.top_k < scaled.shape[-1]:
        kth = np.partition(scaled, -params.top_k, axis=-1)[:, -params.top_k][:, None]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    scaled -= scaled.max(axis=-1, keepdims=True)
    probs = np.exp(scaled)
    probs /= probs.sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        probs = _top_p_filter(probs, params.top_p)
    return probs


def _top_p_filter(probs: np.ndarray, top_p: float) -> np.ndarray:
    order = np.argsort(-probs, axis=-1)
    sorted_probs = np.take_along_axis(probs, order, axis=-1)
    # keep the smallest prefix whose mass reaches top_p (the token crossing it included)
    mass_before = np.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = mass_before < top_p
    keep = np.zeros_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, axis=-1)
    filtered = np.where(keep, probs, 0.0)
    return filtered / filtered.sum(axis=-1, keepdims=True)


def sample_from(probs: np.ndarray, rng: np.random.Generator) -> int:
    return int(rng.choice(probs.shape[-1], p=probs))


def sampled_walk(tree: DraftTree, probs_at: Callable[[int], np.ndarray],
                 rng: np.random.Generator) -> tuple[list[int], int]:
    """The tree rule of the module docstring. probs_at(row) = the target's probabilities after
    row `row` (0 = the anchor; asked only for the rows the walk reaches). Siblings must hold
    distinct tokens (build_tree's do: each position's top k), or p(c) would count twice.

    Returns (the kept path's nodes, in order; the token after the last of them)."""
    path, node = [], 0
    while True:
        probs = probs_at(node)
        children = tree.children_of(node)
        if not children:  # the bonus token
            return path, sample_from(probs, rng)
        draw, mass = rng.random(), 0.0
        for token_id, child in children:
            mass += probs[token_id]
            if draw < mass:
                break
        else:
            residual = probs.copy()
            residual[[token_id for token_id, _ in children]] = 0.0
            total = residual.sum()
            if total > 0:
                return path, sample_from(residual / total, rng)
            # p lies on the children alone and rounding left the draw past their sum
            token_id, child = max(children, key=lambda pair: probs[pair[0]])
        path.append(child)
        node = child
