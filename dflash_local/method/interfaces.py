"""The two interfaces each framework implements for the speculative loop (speculative.py).

A `TargetRunner` is one generation's view of the target (its KV cache, the drafter's taps); a
`Drafter` one generation's view of the drafter (its context cache). Logits cross as numpy
arrays; taps stay opaque to the loop.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from dflash_local.method.draft_tree import DraftTree


class TargetRunner(Protocol):
    """One generation's view of the target: owns its cache, collects the drafter's taps."""

    max_context: int
    supports_tree: bool  # verify takes any tree; False: chains only (the planners ask for no other)

    def prefill(self, prompt_ids: list[int], start: int = 0) -> tuple[np.ndarray, Any]:
        """Run the prompt after its first `start` rows (already in the cache: a kept prefix,
        prefix_cache.py). Returns (logits of the last position [V], taps of the rows run)."""

    def verify(self, anchor_id: int, tree: DraftTree) -> np.ndarray:
        """Run the anchor and the tree's nodes on top of the cache, each node at its depth's
        position and seeing only its ancestors. Returns logits [N+1, V] (row 0: the anchor's)."""

    def commit(self, rows: list[int]) -> Any:
        """Keep these rows of the last verify (ascending, row 0 first) as the next positions,
        roll the rest back; return their taps."""

    def join_taps(self, chunks: list[Any]) -> Any:
        """Concatenate tap chunks along the row axis (rows of rounds the drafter skipped)."""


class Drafter(Protocol):
    """One generation's view of the drafter: owns the draft context cache."""

    drafter_block: int  # the width it was trained on: at most drafter_block - 1 drafts a round
    tree_drafts: bool  # propose_tree works; False: chains only

    def propose(self, anchor_id: int, new_taps: Any, width: int) -> list[int]:
        """Append new_taps to the context, draft the block [anchor, MASK * (width-1)]; return the
        width-1 argmax proposals for block positions 1..width-1."""

    def propose_tree(self, anchor_id: int, new_taps: Any, nodes: int) -> DraftTree:
        """As `propose` with width nodes + 1, but the `nodes` most probable paths (draft_tree.py)."""
