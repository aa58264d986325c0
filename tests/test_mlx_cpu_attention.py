"""The MLX CPU attention: mx.fast's results to float32 rounding, and only where it applies."""

from __future__ import annotations

import sys

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from mlx_lm.models import base
from mlx_tiny import build_model

from dflash_local.engines import mlx_cpu_attention
from dflash_local.engines.mlx_cpu_attention import cpu_attention, grouped_attention


def _qkv(heads, kv_heads, rows, keys_len, seed=0):
    mx.random.seed(seed)
    return (mx.random.normal((1, heads, rows, 16)), mx.random.normal((1, kv_heads, keys_len, 16)),
            mx.random.normal((1, kv_heads, keys_len, 16)))


def _tree_mask(rows, keys_len):
    visible = np.ones((rows, keys_len), dtype=bool)
    visible[:, keys_len - rows:] = np.tril(np.ones((rows, rows), dtype=bool))
    visible[3, keys_len - rows + 2] = False  # a sibling, not an ancestor
    return mx.array(visible)


MASKS = {
    "none": lambda rows, keys_len: None,
    "causal": lambda rows, keys_len: "causal",
    "boolean": _tree_mask,
    "additive": lambda rows, keys_len: mx.where(_tree_mask(rows, keys_len), 0.0, -1e9),
    "4-d boolean": lambda rows, keys_len: _tree_mask(rows, keys_len)[None, None],
}


@pytest.mark.parametrize("mask_kind", sorted(MASKS))
@pytest.mark.parametrize(("heads", "kv_heads", "rows"), [(8, 2, 5), (6, 6, 5), (9, 3, 1), (9, 3, 16)])
def test_grouped_attention_equals_the_stock_kernel(mask_kind, heads, kv_heads, rows):
    queries, keys, values = _qkv(heads, kv_heads, rows, keys_len=40)
    mask = MASKS[mask_kind](rows, 40) if rows > 1 or mask_kind in ("none", "causal") else None
    ours = grouped_attention(queries, keys, values, 0.25, mask)
    stock = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.25, mask=mask)
    np.testing.assert_allclose(np.array(ours), np.array(stock), rtol=2e-5, atol=2e-6)


def test_a_causal_block_sees_the_keys_up_to_its_own_row():
    queries, keys, values = _qkv(4, 2, 3, keys_len=10)
    ours = grouped_attention(queries, keys, values, 0.25, "causal")
    for row in range(3):  # row i of a 3-row block at the end of 10 keys sees keys 0..7+i
        visible = 8 + row
        alone = grouped_attention(queries[:, :, row : row + 1], keys[:, :, :visible], values[:, :, :visible], 0.25, None)
        np.testing.assert_allclose(np.array(ours[:, :, row]), np.array(alone[:, :, 0]), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="unknown attention mask"):
        grouped_attention(queries, keys, values, 0.25, "sliding")


def test_sinks_and_quantized_caches_go_to_mlx_lm_unchanged(monkeypatch):
    calls = []

    def stock(*args, **kwargs):
        calls.append(kwargs)
        return "stock"

    monkeypatch.setattr(mlx_cpu_attention, "_STOCK", stock)
    queries, keys, values = _qkv(4, 2, 3, keys_len=10)
    assert cpu_attention(queries, keys, values, None, 0.25, None, sinks=mx.zeros((4,))) == "stock"

    class QuantizedCache:
        bits, group_size = 4, 32

    assert cpu_attention(queries, keys, values, QuantizedCache(), 0.25, None) == "stock"
    assert len(calls) == 2
    assert cpu_attention(queries, keys, values, None, 0.25, None).shape == queries.shape
    assert len(calls) == 2
    half = cpu_attention(queries.astype(mx.float16), keys.astype(mx.float16), values.astype(mx.float16),
                         None, 0.25, None)
    assert half.dtype == mx.float16  # mx.fast's kernel, not ours: ours is for float32


def test_the_engine_routes_its_model_module_through_it(monkeypatch):
    model, _ = build_model("llama")
    module = sys.modules[type(model).__module__]
    monkeypatch.setattr(module, "scaled_dot_product_attention", base.scaled_dot_product_attention)
    assert mlx_cpu_attention.use_cpu_attention(model)
    assert module.scaled_dot_product_attention is cpu_attention
