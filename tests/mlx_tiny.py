"""Tiny random-weight mlx-lm targets, built from configs with mlx-lm's own model classes.

`write_target` saves one as a directory `mlx_lm.load` reads (config.json + model.safetensors +
the tiny tokenizer); the qwen3 and llama configs are also complete HF configs, so
transformers loads the same directory (the MLX/torch parity test relies on it).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import make_prompt_cache
from tiny_models import VOCAB, make_tokenizer

from dflash_local.accel import mlx_attention
from dflash_local.engines.mlx_adapters import adapter_for

HIDDEN = 64
INIT_STD = 0.15  # larger than default: greedy output depends on the prompt instead of collapsing

_ATTENTION = {
    "hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": HIDDEN // 4, "rms_norm_eps": 1e-6, "vocab_size": VOCAB,
    "max_position_embeddings": 1024,
}
_HF = {"eos_token_id": 2, "pad_token_id": 0, "bos_token_id": None, "hidden_act": "silu",
       "attention_bias": False, "torch_dtype": "float32"}

CONFIGS: dict[str, dict] = {
    "qwen3": {**_ATTENTION, **_HF, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
              "num_hidden_layers": 6, "rope_theta": 1_000_000.0, "tie_word_embeddings": True},
    "llama": {**_ATTENTION, **_HF, "model_type": "llama", "architectures": ["LlamaForCausalLM"],
              "num_hidden_layers": 6, "rope_theta": 10_000.0, "tie_word_embeddings": False,
              "mlp_bias": False},
    "llama_sliding": {**_ATTENTION, "model_type": "llama", "num_hidden_layers": 4,
                      "rope_theta": 10_000.0, "tie_word_embeddings": True, "sliding_window": 6,
                      "layer_types": ["sliding_attention", "full_attention"] * 2},
    "qwen3_moe": {**_ATTENTION, "model_type": "qwen3_moe", "num_hidden_layers": 4,
                  "rope_theta": 1e6, "tie_word_embeddings": True, "num_experts": 4,
                  "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
                  "moe_intermediate_size": 32, "norm_topk_prob": True},
    "qwen3_5": {"model_type": "qwen3_5", "text_config": {
        **_ATTENTION, "model_type": "qwen3_5_text", "num_hidden_layers": 6,
        "full_attention_interval": 3, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
        "tie_word_embeddings": True,
        "rope_parameters": {"type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25},
    }},
    "qwen3_5_moe": {"model_type": "qwen3_5_moe", "text_config": {
        **_ATTENTION, "model_type": "qwen3_5_moe_text", "num_hidden_layers": 4,
        "full_attention_interval": 2, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
        "tie_word_embeddings": True, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
        "rope_parameters": {"type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25},
    }},
    "qwen3_next": {
        **_ATTENTION, "model_type": "qwen3_next", "num_hidden_layers": 4,
        "full_attention_interval": 2, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
        "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 32, "mlp_only_layers": [], "moe_intermediate_size": 32,
        "rope_theta": 10_000.0, "partial_rotary_factor": 0.25, "tie_word_embeddings": False,
    },
    "gpt_oss": {
        **_ATTENTION, "model_type": "gpt_oss", "num_hidden_layers": 4, "num_local_experts": 4,
        "num_experts_per_tok": 2, "sliding_window": 6, "rope_theta": 10_000.0,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    },
    "gemma3_text": {**_ATTENTION, "model_type": "gemma3_text", "num_hidden_layers": 6,
                    "sliding_window": 6, "sliding_window_pattern": 3, "query_pre_attn_scalar": 16},
    "gemma4_text": {
        **_ATTENTION, "model_type": "gemma4_text", "num_hidden_layers": 6, "global_head_dim": 16,
        "num_kv_shared_layers": 2, "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": VOCAB, "sliding_window": 6, "sliding_window_pattern": 3,
        "final_logit_softcapping": 30.0, "use_double_wide_mlp": False, "tie_word_embeddings": True,
    },
}
CONFIGS["gemma3"] = {"model_type": "gemma3", "vocab_size": VOCAB, "text_config": CONFIGS["gemma3_text"]}
CONFIGS["gemma4"] = {"model_type": "gemma4", "vocab_size": VOCAB, "text_config": CONFIGS["gemma4_text"]}


def build_model(family: str, seed: int = 0, **overrides):
    """A random model of the family (config entries overridden), with mlx-lm's own classes;
    returns (model, config)."""
    config = {**json.loads(json.dumps(CONFIGS[family])), **overrides}
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    mx.random.seed(seed)
    params = []
    for name, value in tree_flatten(model.parameters()):
        experts = value.ndim == 3 and "switch_mlp" in name  # MoE: one matrix per expert
        if (value.ndim == 2 or experts) and "norm" not in name:
            value = INIT_STD * mx.random.normal(value.shape)
        params.append((name, value))
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    # as MLXEngine loads a target: every test runs the kernel and the RoPE users get
    mlx_attention.install(model)
    adapter_for(config["model_type"]).install_row_rope(model)
    return model, config


def write_target(out: Path, family: str, seed: int = 0, quantize_bits: int | None = None) -> Path:
    """A directory mlx_lm.load reads; qwen3/llama ones load in transformers too (unquantized)."""
    model, config = build_model(family, seed)
    if quantize_bits is not None:
        config["quantization"] = {"group_size": 32, "bits": quantize_bits}
        model.set_dtype(mx.bfloat16)  # as mlx-community ships them: bf16 scales and norms
        nn.quantize(model, group_size=32, bits=quantize_bits)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    make_tokenizer(out)
    return out


def zlab_mlx_config(zlab, config, num_target_layers: int, **dflash2):
    """z-lab's MLX DFlashConfig for a drafter of ours (`config`: DrafterConfig); `dflash2`: its
    DFlash 2 sizes, for a DFlash2DraftModel."""
    return zlab.DFlashConfig(
        hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
        intermediate_size=config.intermediate_size, vocab_size=config.vocab_size,
        rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta,
        max_position_embeddings=config.max_position_embeddings, block_size=config.block_size,
        target_layer_ids=config.target_layer_ids, num_target_layers=num_target_layers,
        mask_token_id=config.mask_token_id, **dflash2)


class LayerRecorder:
    """Test-only oracle: wraps a decoder layer and records its output (never in product code)."""

    def __init__(self, layer, sink: dict, index: int):
        self.layer, self.sink, self.index = layer, sink, index

    def __call__(self, *args, **kwargs):
        out = self.layer(*args, **kwargs)
        self.sink[self.index] = out[0] if isinstance(out, tuple) else out
        return out

    def __getattr__(self, name):  # the model reads layer flags (use_sliding, is_linear, ...)
        return getattr(self.layer, name)


def reference_outputs(model, layers: list, steps: list[list[int]]):
    """The model's own forward over successive inputs (one cache), with every decoder layer's
    output recorded: [(logits, {layer index: output}) per step], as numpy arrays."""
    import numpy as np

    originals, outputs = list(layers), []
    cache = make_prompt_cache(model)
    try:
        for token_ids in steps:
            recorded: dict = {}
            layers[:] = [LayerRecorder(layer, recorded, i) for i, layer in enumerate(originals)]
            logits = model(mx.array([token_ids]), cache=cache)
            outputs.append((np.array(logits[0]), {i: np.array(v[0]) for i, v in recorded.items()}))
    finally:
        layers[:] = originals
    return outputs
