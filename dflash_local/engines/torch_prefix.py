"""The Transformers engine's state, out of a finished generation and into a new one: the
target's DynamicCache, the drafter's context cache and the taps it has not read
(`prefix_cache.PrefixStates`; the policy is prefix_cache.py's).

A full-attention cache trims to any prefix: its keys and values are kept per layer. A target
with sliding-window layers (they have dropped rows past their window) or recurrent ones (a hybrid's
GatedDeltaNet conv and recurrent states) cannot be trimmed: its layers are kept whole, as copies
of the cache's own layer objects, where the prompt ends and where the generation ends (a turn's
two ends, as MLX does), each reusable only by a prompt that extends it whole. A layer kind that
is neither (a static or quantized cache) is not kept (the reason is logged).
Entries are never written after they are stored: restoring copies the rows (DynamicCache grows
by concatenation), or the whole layers (recurrent layers update their states in place), and
slices the drafter's.
The disk tier's codec (method/prefix_disk_format.py) is `TorchPrefixCodec`: tensors to numpy and
back (bfloat16 as its bits), the kept layer objects by their attributes.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch
from transformers import cache_utils
from transformers.cache_utils import (
    CacheLayerMixin,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
    StaticLayer,
)

from dflash_local.drafter.model_torch import ContextCache, DraftSession
from dflash_local.method.prefix_cache import Kept
from dflash_local.pairs.memory_fit import prefix_row_bytes


@dataclass(frozen=True)
class _DrafterContext:
    keys: list[torch.Tensor | None]
    values: list[torch.Tensor | None]
    start: int  # absolute position of the first row held (a draft window slides it)
    end: int


@dataclass(frozen=True)
class _State:
    # per layer: keys, values [1, kv, rows, d]; or, kept whole, copies of the layer objects
    target: list[tuple[torch.Tensor, torch.Tensor]] | list
    drafter: _DrafterContext | None
    unseen_taps: torch.Tensor | None  # rows [drafter.end, rows) the drafter has not read
    whole: bool = False


def _trims(layers) -> bool:
    return all(type(layer) is DynamicLayer for layer in layers)


def _kept_whole(layer) -> bool:
    """A dynamic layer that has dropped rows or holds a recurrent state (what torch_rollback.py
    rolls back); static and quantized caches are not among them."""
    return (isinstance(layer, DynamicSlidingWindowLayer | LinearAttentionCacheLayerMixin)
            and not isinstance(layer, StaticLayer)) or type(layer) is DynamicLayer


class TorchPrefixStates:
    def accepts(self, drafter) -> bool:
        return drafter is None or isinstance(drafter, DraftSession)

    def keeps_prompt(self, runner) -> bool:
        return not _trims(runner.cache.layers)  # a state kept whole: the prompt's end too

    def snapshot(self, runner, drafter, unseen_taps) -> Kept | str:
        layers = runner.cache.layers
        odd = sorted({type(layer).__name__ for layer in layers if not _kept_whole(layer)})
        if odd:
            return (f"the target's {', '.join(odd)} cache layers can be neither trimmed nor kept "
                    f"whole: prefixes of this target are not kept on the transformers engine")
        whole = not _trims(layers)
        if whole:  # copied outside inference mode: a layer's counters are updated in place later
            target = copy.deepcopy(layers)
        else:
            with torch.inference_mode():
                target = [(layer.keys.clone(), layer.values.clone()) for layer in layers]
        context = None
        if drafter is not None:
            cache = drafter.cache
            context = _DrafterContext(list(cache.keys), list(cache.values), cache.start, cache.end)
        state = _State(target, context, unseen_taps, whole)
        return Kept(state, _nbytes(state), whole_only=whole, has_taps=drafter is not None)

    def restore(self, kept: Kept, rows: int, runner, drafter):
        state: _State = kept.state
        if state.whole:  # rows: all of them (prefix_cache serves such an entry only whole)
            runner.cache.layers = copy.deepcopy(state.target)
        else:
            with torch.inference_mode():
                for index, (keys, values) in enumerate(state.target):
                    runner.cache.update(keys[:, :, :rows], values[:, :, :rows], index)
        if drafter is None or state.drafter is None:
            return None
        context = state.drafter
        if rows >= context.end:  # every row the drafter read, then some of the unseen taps
            drafter.cache = _context_cache(context, context.end, drafter.cache.window)
            unseen = state.unseen_taps
            return unseen[:, : rows - context.end] if rows > context.end else None
        # a shorter prefix: the drafter's rows past it go; rows before a draft window's start
        # are gone already, so the drafter starts empty at that position (drafts only differ)
        drafter.cache = _context_cache(context, rows if rows >= context.start else None,
                                       drafter.cache.window, at=rows)
        return None


def _context_cache(context: _DrafterContext, end: int | None, window: int | None,
                   at: int | None = None) -> ContextCache:
    """The drafter's context up to `end` (None: empty, positioned at `at`)."""
    count = len(context.keys)
    if end is None:
        return ContextCache([None] * count, [None] * count, start=at, end=at, window=window)
    held = end - context.start

    def cut(tensor):
        return None if tensor is None else tensor[:, :, :held]

    return ContextCache([cut(k) for k in context.keys], [cut(v) for v in context.values],
                        start=context.start, end=end, window=window)


def _nbytes(state: _State) -> int:
    tensors = (_layer_tensors(state.target) if state.whole
               else [t for pair in state.target for t in pair])
    if state.drafter is not None:
        tensors += [t for t in (*state.drafter.keys, *state.drafter.values) if t is not None]
    if state.unseen_taps is not None:
        tensors.append(state.unseen_taps)
    return sum(t.nbytes for t in tensors)


def row_bytes(model, tap_count: int) -> int:
    """memory_fit.prefix_row_bytes of a loaded Transformers model, in the dtype it runs in."""
    return prefix_row_bytes(model.config.to_dict(), model.get_input_embeddings().weight.element_size(),
                            tap_count)


def _layer_tensors(value) -> list[torch.Tensor]:
    """Every tensor a kept layer object holds (its attributes, their dicts and lists)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _layer_tensors(item)]
    if isinstance(value, list | tuple):
        return [t for item in value for t in _layer_tensors(item)]
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return _layer_tensors(vars(value))
    return []


class TorchPrefixCodec:
    """The disk tier's view of a Transformers state (prefix_disk_format.LeafCodec): tensors
    come back on `device`."""

    def __init__(self, device: str | torch.device):
        self.device = torch.device(device)
        self.identity = f"torch:{self.device}"  # part of the pair's key

    def to_numpy(self, value) -> tuple[np.ndarray, str] | None:
        if not isinstance(value, torch.Tensor):
            return None
        dtype = str(value.dtype).removeprefix("torch.")
        value = value.detach().cpu()
        if value.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits travel as uint16
            value = value.view(torch.uint16)
        return value.numpy(), dtype

    def from_numpy(self, array: np.ndarray, dtype: str) -> torch.Tensor:
        tensor = torch.from_numpy(array.copy() if not array.flags.writeable else array)
        if dtype == "bfloat16":
            tensor = tensor.view(torch.bfloat16)
        return tensor.to(self.device)

    def to_tag(self, value) -> str | None:
        if isinstance(value, torch.dtype):
            return "dtype:" + str(value).removeprefix("torch.")
        if isinstance(value, torch.device):
            return "device:" + str(value)
        return None

    def from_tag(self, tag: str):
        kind, _, name = tag.partition(":")
        if kind == "dtype":
            return getattr(torch, name)
        return torch.device(name)

    def object_type(self, name: str) -> type | None:
        """Our state's dataclasses and transformers' cache layers (what a whole entry holds)."""
        if name in ("_State", "_DrafterContext"):
            return {"_State": _State, "_DrafterContext": _DrafterContext}[name]
        found = getattr(cache_utils, name, None)
        layer_kinds = (CacheLayerMixin, LinearAttentionCacheLayerMixin)
        return found if isinstance(found, type) and issubclass(found, layer_kinds) else None
