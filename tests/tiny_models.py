"""Tiny random-weight targets and z-lab-format drafters, built from configs and written to disk.

Everything here is real: real transformers model classes, a real tokenizer (byte-level BPE with
no merges), real safetensors files with z-lab's weight names, loaded back through our loaders.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]


def make_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: index for index, token in enumerate(SPECIALS + sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", bos_token=None,
        pad_token="<|endoftext|>", additional_special_tokens=SPECIALS[1:],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    return tokenizer


VOCAB = len(SPECIALS) + 256
MASK_ID = 3


def make_target(out: Path, family: str = "qwen3", seed: int = 0, layers: int = 6, hidden: int = 64,
                tie: bool = True) -> Path:
    """A random-weight target of the given family, saved as a normal HF directory."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    common = {
        "vocab_size": VOCAB, "hidden_size": hidden, "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": hidden // 4, "max_position_embeddings": 1024, "tie_word_embeddings": tie,
        "eos_token_id": 2, "pad_token_id": 0,
    }
    config = Qwen3Config(**common) if family == "qwen3" else LlamaConfig(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # larger-than-default init makes greedy output depend on the prompt, not collapse to one token
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.15)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    make_tokenizer(out)
    return out


# DFlash 2's sizes for a tiny drafter: kernel 4 (a 2- or 3-row block is shorter), 4 groups
DFLASH2 = {"conv_kernel_size": 4, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}


def drafter_config_json(target_dir: Path, layers: int = 2, block_size: int = 16,
                        taps: list[int] | None = None, newer_schema: bool = True,
                        dflash2: dict | None = None, **extra) -> dict:
    """A drafter's config.json as z-lab writes it; `dflash2`: DFlash 2 sizes (DFLASH2) for a
    DFlash2DraftModel, None for v1."""
    target = json.loads((target_dir / "config.json").read_text())
    hidden = target["hidden_size"]
    taps = taps if taps is not None else [1, target["num_hidden_layers"] - 2]
    raw = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": hidden // 4, "intermediate_size": 2 * hidden,
        "vocab_size": target["vocab_size"], "rms_norm_eps": 1e-6, "max_position_embeddings": 1024,
        "rope_theta": 1000000.0, "rope_scaling": None, "attention_bias": False,
        "num_target_layers": target["num_hidden_layers"],
        "dflash_config": {"target_layer_ids": taps, "mask_token_id": MASK_ID},
    }
    if newer_schema:
        raw["dflash_config"]["block_size"] = block_size
    else:
        raw["block_size"] = block_size
    if dflash2 is not None:
        raw["architectures"] = ["DFlash2DraftModel"]
        raw["dflash_config"].update(dflash2)
    raw.update(extra)
    return raw


def dflash2_weights(raw: dict) -> dict[str, torch.Tensor]:
    """DFlash 2's own tensors under z-lab's names (written here, not by the model under test):
    each layer's two convolutions (base kernels near the identity: offset 0 weighs 1) and the
    candidate selector, whose codebooks are stored without `.weight`."""
    sizes, hidden, vocab = raw["dflash_config"], raw["hidden_size"], raw["vocab_size"]
    kernel, groups, rank = sizes["conv_kernel_size"], hidden // sizes["conv_group_size"], sizes["selector_rank"]
    weights = {}
    for layer in range(raw["num_hidden_layers"]):
        for conv in ("attention_conv", "mlp_conv"):
            base = 0.1 * torch.randn(2, kernel, hidden)
            base[:, 0] += 1.0
            weights[f"layers.{layer}.{conv}.base_kernel"] = base
            weights[f"layers.{layer}.{conv}.kernel_projection.weight"] = 0.05 * torch.randn(
                2 * kernel * groups, hidden)
    selector = "candidate_selector"
    weights[f"{selector}.predecessor_codebook"] = 0.5 * torch.randn(vocab, rank)
    weights[f"{selector}.successor_codebook"] = 0.5 * torch.randn(vocab, rank)
    weights[f"{selector}.hidden_projection.weight"] = 0.3 * torch.randn(rank, hidden)
    return weights


def dflash2_from_v1(v1_dir: Path, out: Path, sizes: dict, seed: int = 0) -> Path:
    """A DFlash 2 checkpoint in z-lab's format made from a trained one's layers (a v1's, or a
    DFlash 2's whose own parts are replaced) with convolutions and a selector of these sizes
    near the identity and neutral (small random ones): it drafts about as the trained layers
    do, so rounds keep drafts, while every new part matters."""
    from safetensors.torch import load_file, save_file

    raw = json.loads((v1_dir / "config.json").read_text())
    raw["architectures"] = ["DFlash2DraftModel"]
    raw["dflash_config"] = {**raw["dflash_config"], **sizes}
    torch.manual_seed(seed)
    weights = {name: tensor.float() for name, tensor in load_file(str(v1_dir / "model.safetensors")).items()}
    for name, tensor in dflash2_weights(raw).items():
        weights[name] = tensor if name.endswith("base_kernel") else 0.1 * tensor
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    return out


def make_drafter(out: Path, target_dir: Path, seed: int = 1, **config_kwargs) -> Path:
    """A random drafter in the exact z-lab format: config.json + model.safetensors, bf16."""
    from safetensors.torch import save_file

    from dflash_local.drafter.config import parse_drafter_config
    from dflash_local.drafter.model_torch import DFlashDrafter

    raw = drafter_config_json(target_dir, **config_kwargs)
    torch.manual_seed(seed)
    # the v1 part of the model names the shared tensors; DFlash 2's own come from dflash2_weights
    v1 = {**raw, "architectures": ["DFlashDraftModel"]}
    model = DFlashDrafter(parse_drafter_config(v1))
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.08)
    weights = dict(model.state_dict())
    if raw["architectures"] == ["DFlash2DraftModel"]:
        weights.update(dflash2_weights(raw))
    out.mkdir(parents=True, exist_ok=True)
    # stored as float32 so float32 losslessness tests compare like with like
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    return out
