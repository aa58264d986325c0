"""Several generations' drafts in one pass of the MLX drafter, ragged (DFlash v1).

Every session's new context rows (its taps) are joined into one sequence and so are its blocks
(anchor + MASKs), so the taps projection, each layer's projections and MLP and the draft head are
one matmul over all of them; each block attends only to its own session's context cache and
itself under its own layer masks, and each row sits at its own RoPE position (the per-row RoPE
of accel/mlx_rope.py). Afterwards each session's cache holds what its own propose would append.

Which drafters batch: v1 drafters with a RoPE that places rows one by one. DFlash 2 convolves
along each block (dflash2_mlx.py), which a joined sequence would cross: its sessions, a batch of
one, and a request with no new context rows, draft one by one.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import mlx.core as mx
import numpy as np

from dflash_local.method.draft_tree import DraftTree, tree_from_logits


@dataclass(frozen=True)
class DraftRequest:
    """One session's part of a batched pass: what its `propose` takes (`tree`: `propose_tree`
    with width - 1 nodes)."""

    anchor_id: int
    new_taps: mx.array  # [1, rows, taps * H]: the rows the session's context has not seen
    width: int  # block rows: the anchor and width - 1 proposals
    tree: bool = False


def propose_batch(sessions: Sequence[Any], requests: Sequence[DraftRequest]) -> list[list[int] | DraftTree]:
    """Each session's draft for its request; one pass where they batch (`batches`). `sessions`:
    model_mlx.py's DraftSession (which imports this module for its `propose_batch`)."""
    if len(sessions) != len(requests):
        raise ValueError(f"propose_batch takes one request per session, got {len(sessions)} "
                         f"sessions and {len(requests)} requests")
    if not batches(sessions, requests):
        return [_alone(session, request) for session, request in zip(sessions, requests)]
    model = sessions[0].model
    hidden = _draft_lanes(model, [session.cache for session in sessions], requests)
    logits, ids = model.draft_logits(hidden)  # [1, proposal rows, V'] over every block
    best = mx.argmax(logits, axis=-1)[0]
    best = best if ids is None else mx.take(ids, best)
    ends = list(itertools.accumulate(request.width - 1 for request in requests))
    drafts = []
    for request, start, end in zip(requests, [0, *ends[:-1]], ends, strict=True):
        if request.tree:
            rows = np.array(logits[0, start:end].astype(mx.float32))
            drafts.append(tree_from_logits(rows, None if ids is None else np.array(ids), end - start))
        else:
            drafts.append(best[start:end].tolist())
    return drafts


def batches(sessions: Sequence[Any], requests: Sequence[DraftRequest]) -> bool:
    """Whether one joined pass is exact for these sessions (the module's docstring)."""
    if not sessions:
        return False
    model = sessions[0].model
    models = len({id(session.model) for session in sessions})
    if models > 1:
        raise ValueError(f"propose_batch takes the sessions of one drafter, got {models} drafters")
    return (len(sessions) > 1 and model.config.dflash2 is None and model.row_rope() is not None
            and all(request.new_taps.shape[1] > 0 for request in requests))


def _alone(session, request: DraftRequest) -> list[int] | DraftTree:
    if request.tree:
        return session.propose_tree(request.anchor_id, request.new_taps, request.width - 1)
    return session.propose(request.anchor_id, request.new_taps, request.width)


def _bounds(lengths: list[int]) -> list[tuple[int, int]]:
    ends = list(itertools.accumulate(lengths))
    return list(zip([0, *ends[:-1]], ends, strict=True))


def _draft_lanes(model, caches: list, requests: Sequence[DraftRequest]) -> mx.array:
    """`DFlashDrafter.draft` of every request at once: the final-normed hidden states of each
    block's proposal rows (1..width-1), joined [1, rows, H]."""
    dtype, rope = model.fc.weight.dtype, model.row_rope()
    new_rows = [request.new_taps.shape[1] for request in requests]
    block_starts = [cache.end + rows for cache, rows in zip(caches, new_rows, strict=True)]
    ctx_positions = mx.concatenate([mx.arange(cache.end, start) for cache, start in zip(caches, block_starts)])
    block_positions = mx.concatenate([mx.arange(start, start + request.width)
                                      for start, request in zip(block_starts, requests)])
    mask_id = model.config.mask_token_id
    block_ids = [[request.anchor_id] + [mask_id] * (request.width - 1) for request in requests]
    x = model.embed(mx.array([[token for block in block_ids for token in block]])).astype(dtype)
    ctx = model.hidden_norm(model.fc(mx.concatenate([r.new_taps.astype(dtype) for r in requests], axis=1)))
    ctx_bounds, block_bounds = _bounds(new_rows), _bounds([request.width for request in requests])
    for index, layer in enumerate(model.layers):
        attn = layer.self_attn
        keys, values = attn.context_kv(ctx, rope, ctx_positions)
        contexts = [cache.append(index, keys[:, :, start:end], values[:, :, start:end])
                    for cache, (start, end) in zip(caches, ctx_bounds, strict=True)]
        masks = [model.layer_mask(index, start - context[0].shape[2], start, request.width)
                 for start, context, request in zip(block_starts, contexts, requests, strict=True)]
        x = layer(x, partial(_lanes_attention, attn, rope, block_positions, block_bounds, contexts, masks))
    for cache, start in zip(caches, block_starts, strict=True):
        cache.end = start
    proposal_rows = mx.array([row for start, end in block_bounds for row in range(start + 1, end)],
                             dtype=mx.int32)
    return model.norm(x)[:, proposal_rows]


def _lanes_attention(attn, rope, positions: mx.array, bounds: list[tuple[int, int]], contexts: list,
                     masks: list, rows: mx.array) -> mx.array:
    """The layer's attention of the joined blocks' normed rows, each block over its own context."""
    queries, keys, values = attn.block_qkv(rows, rope, positions)
    outputs = [attn.attend_block(queries[:, :, start:end], keys[:, :, start:end], values[:, :, start:end],
                                 context_keys, context_values, mask)
               for (start, end), (context_keys, context_values), mask
               in zip(bounds, contexts, masks, strict=True)]
    return attn.output(mx.concatenate(outputs, axis=2))
