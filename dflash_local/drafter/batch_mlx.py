"""Several generations' drafts in one pass of the MLX drafter, ragged (DFlash v1).

Every session's new context rows (its taps) are joined into one sequence and so are its blocks
(anchor + MASKs), so the taps projection, each layer's projections and MLP and the draft head are
one matmul over all of them; each block attends only to its own session's context cache and
itself under its own layer masks, and each row sits at its own RoPE position (the per-row RoPE
of accel/mlx_rope.py). Afterwards each session's cache holds what its own propose would append.

Which drafters batch: v1 drafters with a RoPE that places rows one by one. DFlash 2 convolves
along each block (dflash2_mlx.py), which a joined sequence would cross: its sessions, a batch of
one, draft one by one. A session with no new context rows batches too (its block attends to
what its cache holds). A pass that fails part-way leaves every session's cache as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import mlx.core as mx
import numpy as np

from dflash_local.method.draft_tree import DraftTree, tree_from_logits
from dflash_local.method.ragged import check_arguments, spans


def propose_batch(sessions: Sequence[Any], anchors: Sequence[int], new_taps: Sequence[mx.array],
                  widths: Sequence[int]) -> list[list[int]]:
    """Each session's `propose(anchor, taps, width)`; one pass where they batch (`batches`).
    `sessions`: model_mlx.py's DraftSession (which imports this module for its `propose_batch`)."""
    if not batches(sessions, anchors, new_taps, widths):
        return [session.propose(anchor, taps, width)
                for session, anchor, taps, width in zip(sessions, anchors, new_taps, widths)]
    hidden = _draft_lanes(sessions, anchors, new_taps, widths)
    proposals = sessions[0].model.draft_token_ids(hidden)[0].tolist()
    return [proposals[start:end] for start, end in spans([width - 1 for width in widths])]


def propose_tree_batch(sessions: Sequence[Any], anchors: Sequence[int], new_taps: Sequence[mx.array],
                       nodes: Sequence[int]) -> list[DraftTree]:
    """Each session's `propose_tree(anchor, taps, nodes)`; one pass where they batch."""
    widths = [count + 1 for count in nodes]
    if not batches(sessions, anchors, new_taps, widths):
        return [session.propose_tree(anchor, taps, count)
                for session, anchor, taps, count in zip(sessions, anchors, new_taps, nodes)]
    hidden = _draft_lanes(sessions, anchors, new_taps, widths)
    logits, ids = sessions[0].model.draft_logits(hidden)  # [1, every block's proposal rows, V']
    rows, vocab_ids = np.array(logits[0].astype(mx.float32)), None if ids is None else np.array(ids)
    return [tree_from_logits(rows[start:end], vocab_ids, count)
            for (start, end), count in zip(spans(list(nodes)), nodes, strict=True)]


def batches(sessions: Sequence[Any], anchors: Sequence[int], new_taps: Sequence[mx.array],
            widths: Sequence[int]) -> bool:
    """Whether one joined pass is exact for these sessions (the module's docstring); refuses
    arguments that do not pair up."""
    check_arguments("propose_batch", sessions, "session",
                    {"anchors": anchors, "taps": new_taps, "widths": widths},
                    lambda session: session.model, "drafter")
    if not sessions:
        return False
    model = sessions[0].model
    return len(sessions) > 1 and model.config.dflash2 is None and model.row_rope() is not None


def _draft_lanes(sessions: Sequence[Any], anchors: Sequence[int], new_taps: Sequence[mx.array],
                 widths: Sequence[int]) -> mx.array:
    """`_lanes_pass`; a pass that fails part-way trims every session's layer caches back to
    what they held (a compacted layer's old cache restored), none left holding some layers'
    new rows."""
    saved = [(list(s.cache.layers), [layer.offset for layer in s.cache.layers], s.cache.end)
             for s in sessions]
    try:
        return _lanes_pass(sessions, anchors, new_taps, widths)
    except BaseException:
        for session, (layers, offsets, end) in zip(sessions, saved, strict=True):
            for layer, offset in zip(layers, offsets, strict=True):
                if layer.offset > offset:
                    layer.trim(layer.offset - offset)
            session.cache.layers, session.cache.end = layers, end
        raise


def _lanes_pass(sessions: Sequence[Any], anchors: Sequence[int], new_taps: Sequence[mx.array],
                widths: Sequence[int]) -> mx.array:
    """`DFlashDrafter.draft` of every session at once: the final-normed hidden states of each
    block's proposal rows (1..width-1), joined [1, rows, H]."""
    model, caches = sessions[0].model, [session.cache for session in sessions]
    dtype, rope = model.fc.weight.dtype, model.row_rope()
    new_rows = [taps.shape[1] for taps in new_taps]
    block_starts = [cache.end + rows for cache, rows in zip(caches, new_rows, strict=True)]
    ctx_positions = mx.concatenate([mx.arange(cache.end, start) for cache, start in zip(caches, block_starts)])
    block_positions = mx.concatenate([mx.arange(start, start + width)
                                      for start, width in zip(block_starts, widths)])
    mask_id = model.config.mask_token_id
    block_ids = [token for anchor, width in zip(anchors, widths) for token in [anchor] + [mask_id] * (width - 1)]
    x = model.embed(mx.array([block_ids])).astype(dtype)
    ctx = model.hidden_norm(model.fc(mx.concatenate([taps.astype(dtype) for taps in new_taps], axis=1)))
    ctx_bounds, block_bounds = spans(new_rows), spans(list(widths))
    for index, layer in enumerate(model.layers):
        attn = layer.self_attn
        keys, values = attn.context_kv(ctx, rope, ctx_positions)
        contexts = [cache.append(index, keys[:, :, start:end], values[:, :, start:end])
                    for cache, (start, end) in zip(caches, ctx_bounds, strict=True)]
        masks = [model.layer_mask(index, start - context[0].shape[2], start, width)
                 for start, context, width in zip(block_starts, contexts, widths, strict=True)]
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
