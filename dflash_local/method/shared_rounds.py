"""A generation's runner and drafter while other generations share the machine: its drafter's
proposal and its verify are each handed to whoever gathers every generation's into one batch,
and its prefill runs in chunks with a switch point between them, so a long prompt never holds
the others back for more than one chunk. The loop (speculative.py) sees a `TargetRunner` and a
`Drafter` as ever; who shares (the service's lanes, service/lanes.py) implements `RoundSharing`.

Boundary: the runner's interface only, framework-neutral; no scheduling here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from dflash_local.method.draft_tree import DraftTree
from dflash_local.method.interfaces import Drafter, TargetRunner

# prompt rows per prefill forward while others share: the longest a newcomer's prefill holds
# the running streams between two of their rounds
PREFILL_CHUNK_ROWS = 512


class RoundSharing(Protocol):
    """What a shared generation hands over at its switch points."""

    def propose(self, drafter: Drafter, anchor_id: int, new_taps: Any, size: int,
                tree: bool) -> list[int] | DraftTree:
        """`drafter.propose(anchor_id, new_taps, size)` (`tree`: `propose_tree` with `size`
        nodes), run beside the other generations' proposals; the drafter's context cache is
        left as its own call leaves it."""

    def verify(self, runner: TargetRunner, anchor_id: int, tree: DraftTree) -> np.ndarray:
        """`runner.verify(anchor_id, tree)`, run beside the other generations' verifies; the
        runner is left as its own verify leaves it (ready for commit)."""

    def pause(self) -> None:
        """Between two chunks of a prompt's rows: the other generations' rounds may run."""

    def clock(self) -> float:
        """Seconds of this generation's own time (its steps, its part of each batched verify),
        for timing its rounds: the others' steps between its own are not its cost."""

    def in_flight(self) -> int:
        """How many generations' rounds are batched now, this one's included: what the auto
        planner prices a round's part of the batch by (RoundCosts.in_batch)."""



def shared_loop(runner: TargetRunner, drafter: Drafter | None, sharing: RoundSharing | None
                ) -> tuple[TargetRunner, Drafter | None, Callable[[], float]]:
    """The runner and drafter a generation's loop calls and the clock it times rounds on: as
    given and the wall clock alone; shared, their `SharedRunner` and `SharedDrafter` and the
    sharing's clock."""
    if sharing is None:
        return runner, drafter, time.perf_counter
    shared_drafter = SharedDrafter(drafter, sharing) if drafter is not None else None
    return SharedRunner(runner, sharing, PREFILL_CHUNK_ROWS), shared_drafter, sharing.clock


def verify_each(runners: list[TargetRunner], anchor_ids: list[int],
                trees: list[DraftTree]) -> list[np.ndarray]:
    """A batch of verifies, one runner after another: for a runner class without its own
    `verify_batch` (one forward over every runner's rows)."""
    return [runner.verify(anchor_id, tree)
            for runner, anchor_id, tree in zip(runners, anchor_ids, trees, strict=True)]


def propose_each(tree: bool) -> Callable[..., list]:
    """A batch of proposals, one drafter after another: for a drafter class without its own
    `propose_batch` / `propose_tree_batch` (`tree`) (one drafter pass over every session)."""

    def each(drafters: list[Drafter], anchor_ids: list[int], new_taps: list[Any],
             sizes: list[int]) -> list:
        return [(drafter.propose_tree if tree else drafter.propose)(anchor_id, taps, size)
                for drafter, anchor_id, taps, size
                in zip(drafters, anchor_ids, new_taps, sizes, strict=True)]

    return each


class SharedRunner:
    """`runner` with its verify handed to `sharing` and its prefill in chunks of `chunk_rows`
    (the chunks' boundaries depend on the prompt alone, so a generation's rows are computed
    the same however many others run beside it)."""

    def __init__(self, runner: TargetRunner, sharing: RoundSharing,
                 chunk_rows: int = PREFILL_CHUNK_ROWS):
        self.runner = runner
        self.sharing = sharing
        self.chunk_rows = chunk_rows
        self.max_context = runner.max_context
        self.supports_tree = runner.supports_tree

    def prefill(self, prompt_ids: list[int], start: int = 0) -> tuple[np.ndarray, Any]:
        if start >= len(prompt_ids) - self.chunk_rows:  # one chunk (or the runner's own error)
            return self.runner.prefill(prompt_ids, start)
        taps = []
        for chunk_start in range(start, len(prompt_ids), self.chunk_rows):
            if chunk_start > start:
                self.sharing.pause()
            chunk_end = chunk_start + self.chunk_rows
            logits, chunk_taps = self.runner.prefill(prompt_ids[:chunk_end], chunk_start)
            if chunk_taps is not None:
                taps.append(chunk_taps)
        return logits, self.runner.join_taps(taps) if taps else None

    def verify(self, anchor_id: int, tree: DraftTree) -> np.ndarray:
        return self.sharing.verify(self.runner, anchor_id, tree)

    def commit(self, rows: list[int]) -> Any:
        return self.runner.commit(rows)

    def join_taps(self, chunks: list[Any]) -> Any:
        return self.runner.join_taps(chunks)


class SharedDrafter:
    """`drafter` (one generation's `Drafter`) with its proposals handed to `sharing`."""

    def __init__(self, drafter: Drafter, sharing: RoundSharing):
        self.drafter = drafter
        self.sharing = sharing
        self.drafter_block = drafter.drafter_block
        self.tree_drafts = drafter.tree_drafts

    def propose(self, anchor_id: int, new_taps: Any, width: int) -> list[int]:
        return self.sharing.propose(self.drafter, anchor_id, new_taps, width, tree=False)

    def propose_tree(self, anchor_id: int, new_taps: Any, nodes: int) -> DraftTree:
        return self.sharing.propose(self.drafter, anchor_id, new_taps, nodes, tree=True)
