"""Attention for MLX targets and drafters on the CPU: the same math, a cheaper exponential.

On MLX's CPU backend `mx.fast.scaled_dot_product_attention` has no fused kernel: it falls back
to matmul, softmax, matmul, and the softmax's `exp` runs at ~15 ns per element on this x86 CPU
(`mx.power(2, x)` at about half that). A verify of many rows over a long context does that
exp rows x context x heads times per layer: a 16-row verify of the embedded target spent a
fifth of its time there at 300 tokens of context and more as the context grows
(`scripts/mlx_tree_verify_cost.py --attention` times both). `grouped_attention` computes the
softmax as 2^((s - max) * log2 e) and keeps grouped-query heads grouped (one matmul per KV
head, no broadcast copy); results match the stock kernel to float32 rounding (tests).

mlx-lm's model modules call `scaled_dot_product_attention` from `mlx_lm.models.base` by the
name they imported; `use_cpu_attention` points that name, in the loaded model's module, at
`cpu_attention`, which takes what it handles (float32 on the CPU, no quantized cache, no
attention sinks) and hands everything else to mlx-lm's function unchanged. On Metal the
stock fused kernel stays. Our drafter's attention calls `attend`, the same choice.
"""

from __future__ import annotations

import math
import sys

import mlx.core as mx
from mlx_lm.models import base

LOG2_E = math.log2(math.e)
_STOCK = base.scaled_dot_product_attention


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
    if mask is not None:
        scores = mx.where(mask, scores, -mx.inf) if mask.dtype == mx.bool_ else scores + mask
    weights = mx.power(2.0, (scores - scores.max(axis=-1, keepdims=True)) * LOG2_E)
    weights = weights / weights.sum(axis=-1, keepdims=True)
    out = weights.reshape(batch, kv_heads, -1, keys_len) @ values
    return out.reshape(batch, heads, rows, dim)


def attend(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask) -> mx.array:
    """`mx.fast.scaled_dot_product_attention`, computed by `grouped_attention` for float32 on
    the CPU (our drafter calls this)."""
    if queries.dtype == mx.float32 and mx.default_device() == mx.cpu:
        return grouped_attention(queries, keys, values, scale, mask)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def cpu_attention(queries, keys, values, cache, scale: float, mask, sinks=None) -> mx.array:
    """mlx-lm's `scaled_dot_product_attention`: quantized caches and sinks go to it unchanged."""
    if sinks is None and not hasattr(cache, "bits"):
        return attend(queries, keys, values, scale, mask)
    return _STOCK(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)


def use_cpu_attention(model) -> bool:
    """Route the attention of `model`'s mlx-lm module through `cpu_attention` when MLX runs on
    the CPU; True if it now does. Every model of that module in the process shares it (one
    name in one module), and so do plain decoding and mlx-lm's own generate: both sides of a
    comparison run the same kernel."""
    module = sys.modules[type(model).__module__]
    if mx.default_device() != mx.cpu or getattr(module, "scaled_dot_product_attention", None) is None:
        return False
    module.scaled_dot_product_attention = cpu_attention
    return True
