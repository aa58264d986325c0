"""Lanes: several sequences' rows run through a target's layers as one sequence, ragged.

A batched verify (engines/mlx_batch.py) concatenates every generation's verify rows into one
[1, rows] input, so each projection, MLP and the head is one matmul over all of them, while
each generation's rows attend only to its own cache under its own mask. mlx-lm's attention
takes `cache.offset` for its RoPE, stores the new keys and values with
`cache.update_and_fetch`, then calls `scaled_dot_product_attention(..., cache=cache)`: a
`LaneCache` is that cache for one layer of every lane at once. Its `offset` is each row's
position (the per-row RoPE of accel/mlx_rope.py places them), `update_and_fetch` hands each
lane's rows to that lane's own cache (no copy into a padded batch), and the attention routed
by accel/mlx_attention.py sees a `LaneCache` and attends lane by lane (`attend_lanes`).

The layers get `LANES` as their mask: the lanes carry their own, and a kernel that was not
routed refuses that string instead of attending across lanes. A sliding-window layer's
`LaneCache` knows its window and narrows each lane's mask to it (mlx-lm's rule: a row at p sees
keys after p - window); the lanes' caches are plain KVCaches holding every key from position 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from dflash_local.method.ragged import spans

LANES = "lanes"  # the mask a lane run hands every layer: no kernel but the routed one takes it


@dataclass(frozen=True)
class Lane:
    """One sequence's rows in a lane run."""

    cache: list  # its own layer caches (mlx-lm KVCache), the rows go after their contents
    token_ids: list[int]
    positions: mx.array  # [rows] each row's RoPE position
    mask: mx.array | str | None  # its rows' attention mask over its cache and its rows, as a
    # single-sequence verify passes it: None (one row), "causal", or boolean [rows, past + rows]


class LaneCache:
    """One layer's caches of every lane, as mlx-lm's attention uses a cache."""

    def __init__(self, caches: list, bounds: list[tuple[int, int]], positions: mx.array,
                 masks: list, window: int | None = None):
        self.caches = caches
        self.bounds = bounds  # each lane's rows in the joined sequence: [start, end)
        self.offset = positions  # [rows]
        self.masks = masks
        self.window = window  # this layer's sliding window; None: full attention
        self._fetched: list[tuple[mx.array, mx.array]] = []

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Append each lane's rows to its own cache; the attention reads them back per lane
        (`attend_lanes`), so the joined rows return unchanged."""
        self._fetched = [cache.update_and_fetch(keys[:, :, start:end], values[:, :, start:end])
                         for cache, (start, end) in zip(self.caches, self.bounds, strict=True)]
        return keys, values

    def attend_lanes(self, queries: mx.array, scale: float,
                     attention: Callable[..., mx.array]) -> mx.array:
        """`attention(queries, keys, values, scale, mask)` of each lane's rows [1, heads, rows, D]
        over its own keys and values, joined back in row order."""
        outputs = [attention(queries[:, :, start:end], keys, values, scale,
                             self._lane_mask(lane, keys.shape[2]))
                   for lane, ((start, end), (keys, values))
                   in enumerate(zip(self.bounds, self._fetched, strict=True))]
        return mx.concatenate(outputs, axis=2)

    def _lane_mask(self, lane: int, keys: int) -> mx.array | str | None:
        """The lane's mask over its `keys`, narrowed to this layer's window if it has one."""
        mask = self.masks[lane]
        if self.window is None:
            return mask
        start, end = self.bounds[lane]
        positions = self.offset[start:end][:, None]  # [rows, 1]
        key_positions = mx.arange(keys)[None]
        visible = key_positions > positions - self.window
        if mask is None:
            return visible
        if isinstance(mask, str):  # "causal": the rows are the last keys, in order
            mask = mx.arange(keys - (end - start), keys)[:, None] >= key_positions
        return mask & visible


def lane_caches(lanes: Sequence[Lane],
                windows: Sequence[int | None] | None = None) -> tuple[mx.array, list[LaneCache]]:
    """(the joined token ids [1, rows], one `LaneCache` per layer) for a run of `lanes`;
    `windows`: each layer's sliding window (None, or a layer's None: full attention)."""
    bounds = spans([len(lane.token_ids) for lane in lanes])
    positions = mx.concatenate([lane.positions for lane in lanes])
    masks = [lane.mask for lane in lanes]
    windows = windows or [None] * len(lanes[0].cache)
    caches = [LaneCache([lane.cache[layer] for lane in lanes], bounds, positions, masks, window)
              for layer, window in enumerate(windows)]
    token_ids = mx.array([[token for lane in lanes for token in lane.token_ids]])
    return token_ids, caches
