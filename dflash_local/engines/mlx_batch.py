"""The batched verify of several MLX generations: one forward over all their rows, ragged.

Every runner's verify rows (its anchor and its tree's nodes: a plain step, a chain or a tree)
are joined into one sequence, so each projection, MLP and the head is one matmul over all of
them, while each runner's rows attend only to its own KV cache under its own mask and sit at
their own RoPE positions (accel/mlx_lanes.py): no cache is copied, none padded. Afterwards each
runner holds its rows as its own verify would (keys and values appended, taps pending), so the
loop commits as after `verify`.

Which targets batch, whose attention runs through accel/mlx_attention.py's router: those a
tree verify is exact on (`MLXTargetRunner.supports_tree`: every layer full attention with a
per-row RoPE, none recurrent: Qwen3, Qwen3-MoE, Llama, Mistral), and, for their chains and plain
steps (the only drafts their own verify takes), sliding-window targets whose adapter declares
each layer's window (`TargetAdapter.layer_windows`: Llama / Mistral with a window): each lane is
masked to its window layer by layer. Verified runner by runner: a batch of one; gpt-oss (its
attention sinks are not taken lane by lane), Gemma 3 and Gemma 4 (layer patterns and per-layer
RoPEs not declared to the lanes); hybrid targets (Qwen3.5, Qwen3-Next), whose GatedDeltaNet
layers are no attention over a cache: their recurrent state would run lane by lane row by row,
most of the layer's cost, and a rejected row is undone by restoring and replaying that state,
which the lanes do not hold per lane.

A forward that fails part-way trims every runner's cache back to its committed rows before the
error goes on, so none is left holding some layers' new rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from dflash_local.accel import mlx_attention, mlx_rope
from dflash_local.accel.mlx_lanes import LANES, Lane, lane_caches
from dflash_local.engines.mlx_adapters import LayerRun, TargetAdapter
from dflash_local.method.draft_tree import DraftTree
from dflash_local.method.ragged import check_arguments


class LaneRunner(Protocol):
    """What a batched verify needs of engines/mlx_engine.py's MLXTargetRunner (which imports
    this module for its `verify_batch`)."""

    model: Any
    adapter: TargetAdapter
    cache: list  # its layer caches (mlx-lm KVCache)
    tap_ids: tuple[int, ...] | None
    supports_tree: bool

    def verify(self, anchor_id: int, tree: DraftTree) -> np.ndarray: ...

    def lane(self, anchor_id: int, tree: DraftTree) -> Lane: ...

    def take_lane(self, run: LayerRun, rows: slice) -> mx.array | None: ...

    def drop_verified(self) -> None: ...


def verify_batch(runners: Sequence[LaneRunner], anchors: Sequence[int],
                 trees: Sequence[DraftTree]) -> list[np.ndarray]:
    """Each runner's `verify(anchor, tree)`; one forward where they batch (`batches`)."""
    check_arguments("verify_batch", runners, "runner", {"anchors": anchors, "trees": trees},
                    lambda runner: runner.model, "model")
    if not batches(runners, trees):
        return [runner.verify(anchor, tree) for runner, anchor, tree in zip(runners, anchors, trees)]
    committed = [runner.cache[0].offset for runner in runners]
    try:
        return _lanes_verify(runners, anchors, trees)
    except BaseException:
        _restore(runners, committed)
        raise


def _lanes_verify(runners, anchors, trees) -> list[np.ndarray]:
    model, adapter = runners[0].model, runners[0].adapter
    lanes = [runner.lane(anchor, tree) for runner, anchor, tree in zip(runners, anchors, trees)]
    token_ids, caches = lane_caches(lanes, adapter.layer_windows(model))
    tap_ids = frozenset().union(*(runner.tap_ids or () for runner in runners))
    run = adapter.run(model, token_ids, caches, tap_ids, mask=LANES)
    logits = adapter.logits(model, run.hidden).astype(mx.float32)  # [1, rows, V]
    bounds = caches[0].bounds
    taps = [runner.take_lane(run, slice(start, end))
            for runner, (start, end) in zip(runners, bounds, strict=True)]
    mx.eval(logits, [tap for tap in taps if tap is not None])
    joined = np.array(logits[0])
    return [joined[start:end] for start, end in bounds]


def _restore(runners, committed: list[int]) -> None:
    """Every layer cache of every runner back to its committed rows (`committed`: each runner's
    offset before the forward), nothing held for commit."""
    for runner, rows in zip(runners, committed, strict=True):
        for layer_cache in runner.cache:
            if layer_cache.offset > rows:
                layer_cache.trim(layer_cache.offset - rows)
        runner.drop_verified()


def batches(runners: Sequence[LaneRunner], trees: Sequence[DraftTree] = ()) -> bool:
    """Whether one forward over these runners' rows, verifying `trees` (a windowed target:
    chains only), is exact (the module's docstring)."""
    if len(runners) < 2:
        return False
    model, adapter = runners[0].model, runners[0].adapter
    if len({id(runner.model) for runner in runners}) != 1 or not mlx_attention.routed(model):
        return False
    if all(runner.supports_tree for runner in runners):
        return True
    return (adapter.layer_windows(model) is not None and all(tree.is_chain for tree in trees)
            and mlx_rope.installed(adapter.text_model(model).layers))
