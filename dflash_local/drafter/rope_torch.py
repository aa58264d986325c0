"""Rotary position embeddings for the PyTorch drafter: plain, or any scaling Transformers knows."""

from __future__ import annotations

import torch
from torch import nn

from dflash_local.drafter.config import DrafterConfig


class RotaryEmbedding(nn.Module):
    """cos/sin for absolute positions; scaled variants through transformers' own rope table."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        inv_freq, self.attention_scaling = _rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions.float()[..., None] * self.inv_freq  # [(b,) T, head_dim/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def _rope_inv_freq(config: DrafterConfig) -> tuple[torch.Tensor, float]:
    if not config.rope_scaling:
        exponents = torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim
        return 1.0 / (config.rope_theta**exponents), 1.0
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = dict(config.rope_scaling)
    rope_type = scaling.get("rope_type", scaling.get("type"))
    hf_config = Qwen3Config(
        hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
        head_dim=config.head_dim, max_position_embeddings=config.max_position_embeddings,
        rope_parameters={**scaling, "rope_type": rope_type, "rope_theta": config.rope_theta},
    )
    inv_freq, scaling_factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    return inv_freq.float(), float(scaling_factor)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, heads, T, d]; cos/sin: [T, d], or [b, T, d] when positions differ per row."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    return x * cos + _rotate_half(x) * sin
