"""Per-row RoPE positions for tree verification on MLX, installed once at load.

A tree verify runs the anchor and the draft nodes through the target's layers as one sequence,
each row at the position of its depth instead of `cache.offset + i`. mlx-lm's attention calls
`self.rope(x, offset=cache.offset)` before `cache.update_and_fetch(keys, values)`, so:
`install(layers)` wraps each layer's RoPE in a `RowRope`, which is the original for every
offset mlx-lm passes (an int, a batch's offsets), and a tree verify hands the layers
`at_positions(cache, positions)`: views of their caches whose `offset` is the rows' positions,
one per row. A verify then changes no module of the shared model.
"""

from __future__ import annotations

import mlx.core as mx
from mlx import nn
from mlx_lm.models.rope_utils import Llama3RoPE, SuScaledRoPE, YarnRoPE

from dflash_local.accel import Installed

# RoPEs that take one offset per batch row (they hand it to mx.fast.rope); not the dynamic
# NTK one, whose base depends on the sequence's length
ROW_POSITIONED_ROPES = (nn.RoPE, Llama3RoPE, YarnRoPE, SuScaledRoPE)


class RowRope(nn.Module):
    """A layer's RoPE that also places each row of one sequence at a position of its own."""

    def __init__(self, rope):
        super().__init__()
        self.rope = rope

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        # x: [batch, heads, rows, D]. One position per row of one sequence (rows > 1; for one
        # row the two readings agree): mx.fast.rope takes one offset per batch row, so the rows
        # pass through as a batch of one-row sequences and come back as one sequence
        if (isinstance(offset, mx.array) and offset.ndim == 1 and x.shape[0] == 1
                and offset.shape[0] == x.shape[2] > 1):
            return self.rope(x.swapaxes(0, 2), offset=offset).swapaxes(0, 2)
        return self.rope(x, offset=offset)


class CacheAtPositions:
    """A layer's cache as a tree verify's rows see it: `offset` is their positions [rows]; the
    keys and values still go after the cache's own (`update_and_fetch`), the rest is the cache's."""

    def __init__(self, cache, positions: mx.array):
        self.cache = cache
        self.offset = positions

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        return self.cache.update_and_fetch(keys, values)

    def __getattr__(self, name: str):
        return getattr(self.cache, name)


def at_positions(cache: list, positions: mx.array) -> list:
    """Views of a run's layer caches that put its rows at `positions` (one per row)."""
    return [CacheAtPositions(layer_cache, positions) for layer_cache in cache]


def installed(layers) -> bool:
    """Whether every layer's RoPE is a `RowRope`."""
    attentions = [getattr(layer, "self_attn", None) for layer in layers]
    return bool(attentions) and all(isinstance(getattr(attention, "rope", None), RowRope)
                                    for attention in attentions)


def install(layers) -> Installed:
    """Wrap every layer's `self_attn.rope` in a `RowRope`; falsy (nothing changed) unless every
    layer has an attention whose RoPE takes an offset per batch row."""
    attentions = [getattr(layer, "self_attn", None) for layer in layers]
    if not attentions or not all(attention is not None and isinstance(attention.rope, ROW_POSITIONED_ROPES)
                                 for attention in attentions):
        return Installed("mlx_rope")
    ropes = [attention.rope for attention in attentions]
    for attention, rope in zip(attentions, ropes, strict=True):
        attention.rope = RowRope(rope)

    def uninstall() -> None:
        for attention, rope in zip(attentions, ropes, strict=True):
            attention.rope = rope

    return Installed("mlx_rope", uninstall)
