"""The MLX CPU attention: mx.fast's results to float32 rounding, and only where it applies."""

from __future__ import annotations

import sys

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from mlx_lm.models import base
from mlx_tiny import build_model

from dflash_local.accel import mlx_attention
from dflash_local.accel.mlx_attention import NAME, cpu_attention, grouped_attention

on_cpu = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="MLX runs on Metal here: stock kernel")


def _qkv(heads, kv_heads, rows, keys_len, seed=0):
    mx.random.seed(seed)
    return (mx.random.normal((1, heads, rows, 16)), mx.random.normal((1, kv_heads, keys_len, 16)),
            mx.random.normal((1, kv_heads, keys_len, 16)))


def _tree_mask(heads, rows, keys_len):
    visible = np.ones((rows, keys_len), dtype=bool)
    visible[:, keys_len - rows:] = np.tril(np.ones((rows, rows), dtype=bool))
    visible[min(3, rows - 1), keys_len - rows + 1 :] = False  # a sibling, not an ancestor
    return mx.array(visible)


def _per_head(heads, rows, keys_len):
    visible = np.broadcast_to(np.array(_tree_mask(heads, rows, keys_len)), (1, heads, rows, keys_len)).copy()
    visible[0, 1::2, :, :5] = False  # odd heads do not see the first keys
    return mx.array(visible)


def _no_key_for_row_0(heads, rows, keys_len):
    visible = np.array(_tree_mask(heads, rows, keys_len))
    visible[0] = False  # left padding: a row that sees nothing
    return mx.array(visible)


MASKS = {
    "none": lambda heads, rows, keys_len: None,
    "causal": lambda heads, rows, keys_len: "causal",
    "boolean": _tree_mask,
    "additive": lambda heads, rows, keys_len: mx.where(_tree_mask(heads, rows, keys_len), 0.0, -1e9),
    "4-d boolean": lambda heads, rows, keys_len: _tree_mask(heads, rows, keys_len)[None, None],
    "per-head boolean": _per_head,
    "a row sees nothing": _no_key_for_row_0,
}


@pytest.mark.parametrize("mask_kind", sorted(MASKS))
@pytest.mark.parametrize(("heads", "kv_heads", "rows"), [(8, 2, 5), (6, 6, 5), (9, 3, 1), (9, 3, 16)])
def test_grouped_attention_equals_the_stock_kernel(mask_kind, heads, kv_heads, rows):
    queries, keys, values = _qkv(heads, kv_heads, rows, keys_len=40)
    mask = MASKS[mask_kind](heads, rows, 40)
    ours = grouped_attention(queries, keys, values, 0.25, mask)
    stock = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.25, mask=mask)
    assert np.isfinite(np.array(ours)).all()
    np.testing.assert_allclose(np.array(ours), np.array(stock), rtol=2e-5, atol=2e-6)


def test_a_causal_block_sees_the_keys_up_to_its_own_row():
    queries, keys, values = _qkv(4, 2, 3, keys_len=10)
    ours = grouped_attention(queries, keys, values, 0.25, "causal")
    for row in range(3):  # row i of a 3-row block at the end of 10 keys sees keys 0..7+i
        visible = 8 + row
        alone = grouped_attention(queries[:, :, row : row + 1], keys[:, :, :visible],
                                  values[:, :, :visible], 0.25, None)
        np.testing.assert_allclose(np.array(ours[:, :, row]), np.array(alone[:, :, 0]), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="unknown attention mask"):
        grouped_attention(queries, keys, values, 0.25, "sliding")


@on_cpu
def test_only_plain_float32_calls_take_it(monkeypatch):
    taken, stock_calls = [], []
    real = mlx_attention.grouped_attention
    monkeypatch.setattr(mlx_attention, "grouped_attention", lambda *a: taken.append(a[0].dtype) or real(*a))
    monkeypatch.setattr(mlx_attention, "_STOCK", lambda *a, **k: stock_calls.append(k) or a[0])
    queries, keys, values = _qkv(4, 2, 3, keys_len=10)
    cpu_attention(queries, keys, values, None, 0.25, None)
    assert taken == [mx.float32] and not stock_calls

    class QuantizedCache:
        bits, group_size = 4, 32

    cpu_attention(queries, keys, values, None, 0.25, None, sinks=mx.zeros((4,)))
    cpu_attention(queries, keys, values, QuantizedCache(), 0.25, None)
    assert len(stock_calls) == 2 and taken == [mx.float32]
    for dtype in (mx.float16, mx.bfloat16):  # mx.fast's kernel: ours is for float32
        half = cpu_attention(*(a.astype(dtype) for a in (queries, keys, values)), None, 0.25, None)
        assert half.dtype == dtype
    assert taken == [mx.float32]


@on_cpu
@pytest.mark.parametrize(("family", "attention_module"), [("llama", "mlx_lm.models.llama"),
                                                          ("qwen3_5", "mlx_lm.models.qwen3_next")])
def test_every_module_the_model_is_built_from_is_routed(monkeypatch, family, attention_module):
    """A wrapper's attention lives in another module (Qwen3.5's in qwen3_next)."""
    model, _ = build_model(family)
    module = sys.modules[attention_module]
    monkeypatch.setattr(module, NAME, base.scaled_dot_product_attention)
    assert mlx_attention.install(model)
    assert getattr(module, NAME) is cpu_attention


@on_cpu
def test_the_mlx_engine_routes_its_target(monkeypatch, tmp_path):
    from mlx_tiny import write_target

    from dflash_local.engines.mlx_engine import MLXEngine

    target = write_target(tmp_path / "target", "qwen3")
    module = sys.modules["mlx_lm.models.qwen3"]
    monkeypatch.setattr(module, NAME, base.scaled_dot_product_attention)
    MLXEngine(target, None)
    assert getattr(module, NAME) is cpu_attention


@on_cpu
def test_uninstall_puts_the_modules_own_function_back_after_the_last_install(monkeypatch):
    model, _ = build_model("llama")  # installed once, for the session
    module = sys.modules["mlx_lm.models.llama"]
    monkeypatch.setattr(mlx_attention, "_routed", {})  # as in a fresh process
    monkeypatch.setattr(module, NAME, base.scaled_dot_product_attention)
    first, second = mlx_attention.install(model), mlx_attention.install(model)
    first.uninstall()
    assert getattr(module, NAME) is cpu_attention  # the second model still runs it
    second.uninstall()
    second.uninstall()  # once only
    assert getattr(module, NAME) is base.scaled_dot_product_attention
    assert mlx_attention._routed == {}


@on_cpu
def test_closing_the_mlx_engine_unroutes_its_target(monkeypatch, tmp_path):
    from mlx_tiny import write_target

    from dflash_local.accel.mlx_rope import RowRope
    from dflash_local.engines.mlx_engine import MLXEngine

    target = write_target(tmp_path / "target", "qwen3")
    module = sys.modules["mlx_lm.models.qwen3"]
    monkeypatch.setattr(mlx_attention, "_routed", {})
    monkeypatch.setattr(module, NAME, base.scaled_dot_product_attention)
    engine = MLXEngine(target, None)
    layers = engine.adapter.text_model(engine.model).layers
    assert all(isinstance(layer.self_attn.rope, RowRope) for layer in layers)
    engine.close()
    assert getattr(module, NAME) is base.scaled_dot_product_attention
    assert not any(isinstance(layer.self_attn.rope, RowRope) for layer in layers)
