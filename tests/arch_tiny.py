"""Tiny random-weight targets of every architecture the matrix covers, for either local engine,
and a z-lab-format drafter for each: real Transformers classes (`hf_target`) and real mlx-lm
classes (`mlx_tiny.write_target(out, model_type)`: its CONFIGS hold one per model_type), 4-6
layers of width 64, the tiny byte tokenizer.

Each target mixes its architecture's layer kinds (GatedDeltaNet and attention, sliding and full
attention, MoE MLPs) and keeps a sliding window of 6 rows, shorter than a test's prompt plus
output, so rollbacks happen after the window has moved.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tiny_models import VOCAB, make_drafter, make_tokenizer

MODEL_TYPES = ("llama", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next", "gemma4",
               "gpt_oss", "gemma3_text")
TAPS = [0, 1, 2]  # a GatedDeltaNet and an attention layer in each hybrid; never the last layer
LAYERS = 4
WINDOW = 6

_COMMON = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": LAYERS,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 1024, "eos_token_id": 2, "pad_token_id": 0, "bos_token_id": None,
}
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
_GATED_DELTA_NET = {
    "layer_types": ["linear_attention", "full_attention"] * (LAYERS // 2),
    "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
}
_SLIDING = {"sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"] * (LAYERS // 2)}

# model_type -> (the text model's config type, its fields)
HF_CONFIGS: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {**_COMMON, "tie_word_embeddings": False}),
    "qwen3": ("qwen3", {**_COMMON, "tie_word_embeddings": True}),
    "qwen3_moe": ("qwen3_moe", {**_COMMON, **_MOE}),
    "qwen3_5": ("qwen3_5_text", {**_COMMON, **_GATED_DELTA_NET}),
    "qwen3_5_moe": ("qwen3_5_moe_text", {**_COMMON, **_GATED_DELTA_NET, **_MOE,
                                         "shared_expert_intermediate_size": 32}),
    "qwen3_next": ("qwen3_next", {**_COMMON, **_GATED_DELTA_NET, **_MOE,
                                  "shared_expert_intermediate_size": 32}),
    "gemma4": ("gemma4_text", {**_COMMON, **_SLIDING, "global_head_dim": 16,
                               "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 8,
                               "vocab_size_per_layer_input": VOCAB,
                               "final_logit_softcapping": 30.0}),
    "gemma3_text": ("gemma3_text", {**_COMMON, **_SLIDING, "query_pre_attn_scalar": 16}),
    "gpt_oss": ("gpt_oss", {**_COMMON, **_SLIDING, "num_local_experts": 4, "num_experts_per_tok": 2,
                            "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0}}),
}
# sliding-window targets outside the matrix (the ragged verify's tests): every layer windowed
# (Mistral), and windowed layers beside full ones (Qwen3 with use_sliding_window)
WINDOWED_CONFIGS: dict[str, tuple[str, dict]] = {
    "mistral": ("mistral", {**_COMMON, "sliding_window": WINDOW}),
    "qwen3_windowed": ("qwen3", {**_COMMON, **_SLIDING, "use_sliding_window": True}),
}
_TINY_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                "out_hidden_size": 64}
# the multimodal checkpoints as published (Qwen3.5/3.6, Gemma 4): the text model nested in the
# config and in the weights' names, a vision tower beside it (none for Gemma 4 here)
MULTIMODAL = {
    "qwen3_5": {"vision_config": _TINY_VISION},
    "qwen3_5_moe": {"vision_config": _TINY_VISION},
    "gemma4": {"vision_config": None, "audio_config": None},
}


def hf_target(out: Path, model_type: str, seed: int = 0) -> Path:
    """A random target built with the Transformers class of `model_type`, saved as a checkpoint
    directory whose config.json says `model_type` (multimodal ones as published: MULTIMODAL)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    text_type, fields = {**HF_CONFIGS, **WINDOWED_CONFIGS}[model_type]
    config = CONFIG_MAPPING[text_type](**fields)
    model_class = AutoModelForCausalLM
    if model_type in MULTIMODAL:
        config = CONFIG_MAPPING[model_type](text_config=config, **MULTIMODAL[model_type])
        model_class = AutoModelForImageTextToText
    torch.manual_seed(seed)
    model = model_class.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger than default: greedy output depends on the prompt
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.15)
        if model_type.startswith("gemma"):  # embeddings scaled by sqrt(hidden): at 0.15 a token's
            model.get_input_embeddings().weight.normal_(0.0, 0.05)  # own outweighs every layer
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    make_tokenizer(out)
    return out


def drafter_for(out: Path, target_dir: Path, block_size: int = 8, seed: int = 1) -> Path:
    """A z-lab-format drafter tapping TAPS of the target (nested configs: its text model's)."""
    raw = json.loads((target_dir / "config.json").read_text())
    flat = out.parent / f"{out.name}-target-config"
    flat.mkdir(parents=True, exist_ok=True)
    (flat / "config.json").write_text(json.dumps(raw.get("text_config") or raw))
    return make_drafter(out, flat, seed=seed, layers=1, block_size=block_size, taps=TAPS)
