"""The MLX engine's state, out of a finished generation and into a new one: the target's
caches (attention keys and values, and a hybrid target's GatedDeltaNet state), the drafter's
context cache and the taps it has not read (`prefix_cache.PrefixStates`; the policy is
prefix_cache.py's).

Recurrent state cannot be trimmed: a hybrid target's entries are the states where the prompt
and where the generation ended (a turn's two ends), each reusable only whole. Entries are never written after they are stored: MLX caches write
into their buffers in place, so a restore hands each cache a fresh slice, never the entry's array.
The same object is the disk tier's codec (method/prefix_disk_format.py): a kept state's arrays
to numpy and back, bfloat16 carried as its bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache

from dflash_local.drafter.model_mlx import DraftSession
from dflash_local.method.prefix_cache import Kept


@dataclass(frozen=True)
class _DrafterContext:
    layers: list[tuple[mx.array, mx.array] | None]  # keys, values of the rows held, per layer
    end: int  # absolute position after the last row


@dataclass(frozen=True)
class _State:
    target: list[tuple[mx.array, mx.array] | list]  # per layer: (keys, values) or recurrent arrays
    drafter: _DrafterContext | None
    unseen_taps: mx.array | None  # rows [drafter.end, rows) the drafter has not read


def _held(cache: KVCache) -> tuple[mx.array, mx.array] | None:
    if cache.keys is None or cache.offset == 0:
        return None
    return (mx.contiguous(cache.keys[..., : cache.offset, :]),
            mx.contiguous(cache.values[..., : cache.offset, :]))


class MLXPrefixStates:
    def accepts(self, drafter) -> bool:
        return drafter is None or isinstance(drafter, DraftSession)

    def keeps_prompt(self, runner) -> bool:
        return runner.hybrid  # a hybrid's state is reusable only whole

    def snapshot(self, runner, drafter, unseen_taps) -> Kept | str:
        target = []
        for layer_cache in runner.cache:
            if type(layer_cache) is KVCache:
                target.append(_held(layer_cache))
            elif isinstance(layer_cache, ArraysCache):
                target.append(list(layer_cache.cache))
            else:
                return f"the target's {type(layer_cache).__name__} layer cache cannot be kept"
        context = None
        if drafter is not None:
            context = _DrafterContext([_held(c) for c in drafter.cache.layers], drafter.cache.end)
        state = _State(target, context, unseen_taps)
        arrays = _arrays(state)
        mx.eval(arrays)
        return Kept(state, sum(a.nbytes for a in arrays), whole_only=runner.hybrid,
                    has_taps=drafter is not None)

    def restore(self, kept: Kept, rows: int, runner, drafter):
        state: _State = kept.state
        for layer_cache, held in zip(runner.cache, state.target, strict=True):
            if isinstance(layer_cache, ArraysCache):
                layer_cache.cache = list(held)  # replaced, never written in place, by the layers
            elif held is not None:
                _fill(layer_cache, held, rows)
        if drafter is None or state.drafter is None:
            return None
        context = state.drafter
        cache = drafter.model.new_cache(drafter.cache.window)
        cache.end = min(rows, context.end)
        for layer_cache, held in zip(cache.layers, context.layers, strict=True):
            if held is None:
                continue
            # the rows held start at end - held; a shorter prefix before a draft window's start
            # leaves the drafter empty at that position (its drafts only differ)
            count = held[0].shape[2] - (context.end - cache.end)
            if count > 0:
                _fill(layer_cache, held, count)
        drafter.cache = cache
        if rows > context.end and state.unseen_taps is not None:
            return state.unseen_taps[:, : rows - context.end]
        return None


class MLXPrefixCodec:
    """The disk tier's view of an MLX state (prefix_disk_format.LeafCodec)."""

    identity = "default-device"  # part of the pair's key: where the arrays are restored (MLX's default)

    def to_numpy(self, value) -> tuple[np.ndarray, str] | None:
        if not isinstance(value, mx.array):
            return None
        dtype = str(value.dtype).removeprefix("mlx.core.")
        if value.dtype == mx.bfloat16:  # numpy has no bfloat16: its bits travel as uint16
            return np.array(value.view(mx.uint16)), dtype
        return np.array(value), dtype

    def from_numpy(self, array: np.ndarray, dtype: str) -> mx.array:
        value = mx.array(array)
        if dtype == "bfloat16":
            value = value.view(mx.bfloat16)
            mx.eval(value)  # here: an entry read at load is used on the worker's thread
        return value

    def to_tag(self, value) -> str | None:
        return None

    def from_tag(self, tag: str):
        raise ValueError(f"an MLX entry holds no tagged value, got {tag!r}")

    def object_type(self, name: str) -> type | None:
        return {"_State": _State, "_DrafterContext": _DrafterContext}.get(name)


def _fill(cache: KVCache, held: tuple[mx.array, mx.array], rows: int) -> None:
    """The first `rows` rows, as new arrays: the cache may write into them in place."""
    cache.keys, cache.values = held[0][..., :rows, :], held[1][..., :rows, :]
    cache.offset = rows


def _arrays(state: _State) -> list[mx.array]:
    arrays = []
    for held in state.target:
        arrays += [a for a in (held or ()) if a is not None]
    if state.drafter is not None:
        arrays += [a for held in state.drafter.layers for a in (held or ())]
    if state.unseen_taps is not None:
        arrays.append(state.unseen_taps)
    return arrays
