"""The batched verify of several MLX generations: one forward over all their rows, ragged.

Every runner's verify rows (its anchor and its tree's nodes: a plain step, a chain or a tree)
are joined into one sequence, so each projection, MLP and the head is one matmul over all of
them, while each runner's rows attend only to its own KV cache under its own mask and sit at
their own RoPE positions (accel/mlx_lanes.py): no cache is copied, none padded. Afterwards each
runner holds its rows as its own verify would (keys and values appended, taps pending), so the
loop commits as after `verify`.

Which targets batch: those a tree verify is exact on (`MLXTargetRunner.supports_tree`: every
layer full attention with a per-row RoPE, none recurrent: Qwen3, Qwen3-MoE, Llama, Mistral)
whose attention runs through accel/mlx_attention.py's router. Hybrid (Qwen3.5, Qwen3-Next),
sliding-window (gpt-oss, Gemma 3, Llama with a window) and Gemma 4 targets are verified runner
by runner, as is a batch of one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from dflash_local.accel import mlx_attention
from dflash_local.accel.mlx_lanes import LANES, Lane, lane_caches
from dflash_local.engines.mlx_adapters import LayerRun, TargetAdapter
from dflash_local.method.draft_tree import DraftTree
from dflash_local.method.ragged import check_arguments


class LaneRunner(Protocol):
    """What a batched verify needs of engines/mlx_engine.py's MLXTargetRunner (which imports
    this module for its `verify_batch`)."""

    model: Any
    adapter: TargetAdapter
    tap_ids: tuple[int, ...] | None
    supports_tree: bool

    def verify(self, anchor_id: int, tree: DraftTree) -> np.ndarray: ...

    def lane(self, anchor_id: int, tree: DraftTree) -> Lane: ...

    def take_lane(self, run: LayerRun, rows: slice) -> mx.array | None: ...


def verify_batch(runners: Sequence[LaneRunner], anchors: Sequence[int],
                 trees: Sequence[DraftTree]) -> list[np.ndarray]:
    """Each runner's `verify(anchor, tree)`; one forward where they batch (`batches`)."""
    check_arguments("verify_batch", runners, "runner", {"anchors": anchors, "trees": trees},
                    lambda runner: runner.model, "model")
    if not batches(runners):
        return [runner.verify(anchor, tree) for runner, anchor, tree in zip(runners, anchors, trees)]
    lanes = [runner.lane(anchor, tree) for runner, anchor, tree in zip(runners, anchors, trees)]
    token_ids, caches = lane_caches(lanes)
    model, adapter = runners[0].model, runners[0].adapter
    tap_ids = frozenset().union(*(runner.tap_ids or () for runner in runners))
    run = adapter.run(model, token_ids, caches, tap_ids, mask=LANES)
    logits = adapter.logits(model, run.hidden).astype(mx.float32)  # [1, rows, V]
    bounds = caches[0].bounds
    taps = [runner.take_lane(run, slice(start, end))
            for runner, (start, end) in zip(runners, bounds, strict=True)]
    mx.eval(logits, [tap for tap in taps if tap is not None])
    joined = np.array(logits[0])
    return [joined[start:end] for start, end in bounds]


def batches(runners: Sequence[LaneRunner]) -> bool:
    """Whether one forward over these runners' rows is exact (the module's docstring)."""
    if len(runners) < 2:
        return False
    model = runners[0].model
    return (len({id(runner.model) for runner in runners}) == 1 and all(runner.supports_tree for runner in runners)
            and mlx_attention.routed(model))
