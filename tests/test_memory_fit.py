"""The fit estimate worked by hand: KV cache per architecture, recurrent state, the longest context
that fits, what each engine may use, and the weights as an engine holds them."""

from __future__ import annotations

import pytest

from dflash_local.engines.selection import PlatformInfo
from dflash_local.pairs.catalog import load_catalog
from dflash_local.pairs.memory_budget import MachineMemory, budget_for, metal_default_limit
from dflash_local.pairs.memory_fit import (
    WORKING_FLOOR_BYTES,
    estimate_fit,
    kv_cache_bytes,
    recurrent_state_bytes,
    weights_from_params,
)
from dflash_local.pairs.pair_fit import held_bytes, pair_fits

GB = 10**9
EVERYTHING = frozenset({"mlx", "torch", "vllm", "sglang"})
MAC = PlatformInfo("Darwin", "arm64", cuda=False, installed=frozenset({"mlx", "torch"}))
LINUX_CPU = PlatformInfo("Linux", "x86_64", cuda=False, installed=EVERYTHING)
LINUX_GPU = PlatformInfo("Linux", "x86_64", cuda=True, installed=EVERYTHING)
QWEN35_9B = load_catalog().get("qwen3.5-9b-mlx-4bit").architecture()


def test_hybrid_kv_counts_only_the_full_attention_layers():
    # 32 layers, every 4th full attention: 8 layers x 4 KV heads x 256 x 2 (K, V) x 2 bytes
    assert kv_cache_bytes(QWEN35_9B, 8192) == 8 * 4 * 256 * 2 * 8192 * 2 == 268_435_456
    # 24 GatedDeltaNet layers, live + rollback copy: state 32 x 128 x 128 x 4 bytes, conv 3 rows
    # x (2 x 16 x 128 + 32 x 128) channels x 2 bytes
    per_layer = 32 * 128 * 128 * 4 + 3 * (2 * 16 * 128 + 32 * 128) * 2
    assert recurrent_state_bytes(QWEN35_9B, 2) == 2 * 24 * per_layer == 103_022_592


def test_sliding_layers_hold_at_most_their_window():
    gpt_oss = load_catalog().get("gpt-oss-20b-mlx").architecture()
    # 12 sliding layers capped at 128 rows, 12 full layers at 4096; 8 KV heads x 64
    assert kv_cache_bytes(gpt_oss, 4096, 2) == 8 * 64 * 2 * 2 * (12 * 128 + 12 * 4096)
    gemma4 = {"num_hidden_layers": 6, "num_key_value_heads": 16, "head_dim": 256,
              "global_head_dim": 512, "num_global_key_value_heads": 4, "sliding_window": 1024,
              "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
    assert kv_cache_bytes(gemma4, 4096, 2) == 2 * 2 * (5 * 16 * 256 * 1024 + 4 * 512 * 4096)


def test_the_longest_context_that_fits_is_the_edge():
    config = {"num_hidden_layers": 2, "num_key_value_heads": 1, "head_dim": 8,
              "max_position_embeddings": 1 << 20, "torch_dtype": "float32"}
    # per token: target 2 x 1 x 8 x 2 x 4 = 128 bytes, drafter 5 layers like it = 320
    budget = 10 * GB + WORKING_FLOOR_BYTES + int(0.05 * 10 * GB) + 448 * 1000
    fit = estimate_fit(10 * GB, config, 4096, budget)
    assert fit.max_context == 1000 and not fit.fits
    assert fit.label() == "fits up to 1,000 tokens of context"
    assert estimate_fit(10 * GB, config, 1000, budget).fits
    too_small = estimate_fit(10 * GB, config, 4096, 5 * GB)
    assert too_small.max_context is None
    assert too_small.label() == f"does not fit: needs {too_small.total_bytes / GB:.1f} GB, has 5.0 GB"
    whole = estimate_fit(10 * GB, {**config, "max_position_embeddings": 500}, 400, budget)
    assert whole.label() == "fits its whole context (500 tokens)"
    size_only = estimate_fit(10 * GB, None, 4096, 5 * GB)
    assert size_only.label().endswith("(estimate from size only)") and size_only.kv_bytes == 0


def test_what_each_engine_may_use():
    memory = MachineMemory(ram_bytes=64 * 2**30, metal_working_set_bytes=48 * 2**30, metal=True)
    assert budget_for("mlx", MAC, memory).budget_bytes == 48 * 2**30
    unsaid = budget_for("mlx", MAC, MachineMemory(64 * 2**30, None, metal=True))
    assert unsaid.budget_bytes == 48 * 2**30 == metal_default_limit(64 * 2**30)
    assert metal_default_limit(24 * 2**30) == 16 * 2**30
    cpu_mlx = budget_for("mlx", LINUX_CPU, MachineMemory(16 * 2**30))
    assert cpu_mlx.device == "CPU" and "runs on the CPU" in cpu_mlx.note
    assert cpu_mlx.budget_bytes == 16 * 2**30
    for served in ("vllm", "sglang"):
        refused = budget_for(served, MAC, memory)
        assert not refused.runs_here and "needs a CUDA GPU" in refused.note
    gpu = MachineMemory(128 * 2**30, cuda_bytes=80 * 2**30, cuda_name="H100")
    assert budget_for("vllm", LINUX_GPU, gpu).budget_bytes == 80 * 2**30
    assert budget_for("transformers", LINUX_GPU, gpu).device == "CUDA GPU H100"
    missing = budget_for("mlx", PlatformInfo("Linux", "x86_64", False, frozenset()), gpu)
    assert not missing.runs_here and missing.note.startswith("not installed")


def test_a_cpu_holds_unquantized_weights_in_float32():
    catalog = load_catalog()
    bf16 = catalog.get("llama3.1-8b-instruct-mlx-bf16").target
    four_bit = catalog.get("llama3.1-8b-instruct-mlx-4bit").target
    assert held_bytes(bf16, None, None, run_bytes=4) == 2 * int(16.88 * GB)
    assert held_bytes(bf16, None, None, run_bytes=None) == int(16.88 * GB)
    assert held_bytes(four_bit, None, None, run_bytes=4) == int(4.64 * GB)  # kept quantized
    assert weights_from_params(8.0, "4bit") == 4_500_000_000
    with pytest.raises(ValueError, match="quantization '3bit'"):
        weights_from_params(8.0, "3bit")


def test_every_engine_a_pair_names_is_shown_runnable_or_with_its_reason():
    memory = MachineMemory(ram_bytes=32 * 2**30, metal_working_set_bytes=22 * 2**30, metal=True)
    budgets = {engine: budget_for(engine, MAC, memory)
               for engine in ("mlx", "transformers", "vllm", "sglang")}
    for pair in load_catalog().pairs:
        fits = pair_fits(pair, budgets, 8192)
        assert set(fits) == set(pair.engines)
        for engine, entry in fits.items():
            if engine in ("vllm", "sglang"):
                assert entry["label"].startswith("cannot run here: needs a CUDA GPU")
            else:
                assert entry["runs_here"] and entry["label"]
    hybrid = pair_fits(load_catalog().get("qwen3.5-9b-mlx-4bit"), budgets, 8192)
    fit = hybrid["mlx"]["fit"]
    assert fit["basis"] == "catalog architecture" and fit["state_bytes"] == 103_022_592
    assert fit["budget_bytes"] == 22 * 2**30 and hybrid["mlx"]["device"] == "Metal GPU (unified memory)"
