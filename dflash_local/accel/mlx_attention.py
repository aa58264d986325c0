"""Attention for MLX targets and drafters on the CPU: the same math, a cheaper exponential.

On MLX's CPU backend `mx.fast.scaled_dot_product_attention` has no fused kernel: it falls back
to matmul, softmax, matmul, and the softmax's `exp` costs about twice `mx.power(2, x)` on a
CPU. A verify of many rows over a long context pays that rows x context x heads times per layer
(`scripts/experiments/mlx_tree_verify_cost.py --attention both` measures the difference). `grouped_attention` computes the softmax as 2^((s - max) * log2 e), and the scores of each KV
head's group of query heads in one matmul; results match the stock kernel to float32 rounding
(tests), masked-out keys as the stock CPU kernel masks them (the dtype's lowest value, so a row
with no key visible stays finite).

mlx-lm's model modules call `scaled_dot_product_attention` from `mlx_lm.models.base` by the
name they imported; `install(model)` points that name, in every module the loaded model's
layers come from, at `cpu_attention`, which takes what it handles (float32 on the CPU, no
quantized cache, no attention sinks) and hands everything else to mlx-lm's function unchanged;
the last `uninstall()` of a module puts its own function back. On Metal the stock fused kernel
stays (`attend` calls it). The name is routed on every device for one more reason: a batched
verify's `LaneCache` (accel/mlx_lanes.py) is attended lane by lane. Our drafter's attention
calls `attend`, the same choice.
"""

from __future__ import annotations

import logging
import math
import sys

import mlx.core as mx
from mlx_lm.models import base

from dflash_local.accel import Installed
from dflash_local.accel.mlx_lanes import LaneCache

logger = logging.getLogger(__name__)

LOG2_E = math.log2(math.e)
_STOCK = base.scaled_dot_product_attention
NAME = "scaled_dot_product_attention"  # what mlx-lm's model modules call
_routed: dict[str, list] = {}  # module name -> [its own function, live installs routing it]


def grouped_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                      mask: mx.array | str | None) -> mx.array:
    """softmax(q k^T * scale + mask) v for queries [B, heads, rows, D] and keys/values
    [B, kv_heads, N, D]; mask: None, "causal" (row i sees the keys up to N - rows + i), a
    boolean mask (True = visible) or an additive one, broadcastable to [B, heads, rows, N]."""
    batch, heads, rows, dim = queries.shape
    kv_heads, keys_len = keys.shape[1], keys.shape[2]
    grouped = (queries * scale).reshape(batch, kv_heads, heads // kv_heads * rows, dim)
    scores = (grouped @ keys.swapaxes(-1, -2)).reshape(batch, heads, rows, keys_len)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}")
        mask = mx.arange(keys_len - rows, keys_len)[:, None] >= mx.arange(keys_len)[None]
    if mask is not None and mask.dtype == mx.bool_:
        scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
    elif mask is not None:
        scores = scores + mask
    weights = mx.power(2.0, (scores - scores.max(axis=-1, keepdims=True)) * LOG2_E)
    weights = weights / weights.sum(axis=-1, keepdims=True)
    out = weights.reshape(batch, kv_heads, -1, keys_len) @ values
    return out.reshape(batch, heads, rows, values.shape[-1])


def attend(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask) -> mx.array:
    """`mx.fast.scaled_dot_product_attention`, computed by `grouped_attention` for float32 on
    the CPU."""
    if queries.dtype == mx.float32 and mx.default_device() == mx.cpu:
        return grouped_attention(queries, keys, values, scale, mask)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def cpu_attention(queries, keys, values, cache, scale: float, mask, sinks=None) -> mx.array:
    """mlx-lm's `scaled_dot_product_attention`: quantized caches and sinks go to it unchanged;
    the lanes of a batched verify attend one by one."""
    if isinstance(cache, LaneCache):
        if sinks is not None:  # lanes are masked, not sunk: engines/mlx_batch.py batches none
            raise ValueError("a batched verify's lanes take no attention sinks")
        return cache.attend_lanes(queries, scale, attend)
    if sinks is None and not hasattr(cache, "bits"):
        return attend(queries, keys, values, scale, mask)
    return _STOCK(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)


def attention_modules(model) -> list:
    """The mlx-lm modules `model` is built from that call attention by `NAME` (a multimodal
    wrapper's text model lives in another module than the wrapper)."""
    modules = {sys.modules[type(part).__module__] for _, part in model.named_modules()}
    return sorted((module for module in modules if NAME in vars(module)), key=lambda m: m.__name__)


def routed(model) -> bool:
    """Whether `model`'s attention runs through `cpu_attention` (what a batched verify needs)."""
    modules = attention_modules(model)
    return bool(modules) and all(getattr(module, NAME) is cpu_attention for module in modules)


def set_attention(model, function) -> bool:
    """Point `NAME` in every module of `attention_modules(model)` at `function`; True if any.
    The A/B scripts' switch between kernels: the caller sets back what it changed."""
    modules = attention_modules(model)
    for module in modules:
        setattr(module, NAME, function)
    return bool(modules)


def install(model) -> Installed:
    """Route `model`'s attention through `cpu_attention`; falsy if it calls none by name. All
    models of those modules in the process share it (one name per module), plain decoding and
    mlx-lm's own generate included: both sides of a comparison run one kernel."""
    modules = attention_modules(model)
    if not modules:
        logger.info("%s calls no mlx-lm attention by name: its attention stays MLX's own",
                    type(model).__module__)
        return Installed("mlx_attention")
    for module in modules:
        route = _routed.setdefault(module.__name__, [getattr(module, NAME), 0])
        route[1] += 1
        setattr(module, NAME, cpu_attention)
    return Installed("mlx_attention", lambda: _release(modules))


def _release(modules: list) -> None:
    """A module gets its own function back when no loaded model routes it any more."""
    for module in modules:
        route = _routed[module.__name__]
        route[1] -= 1
        if route[1] == 0:
            del _routed[module.__name__]
            setattr(module, NAME, route[0])
