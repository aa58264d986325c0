"""SDPA attention for CPU targets that keeps grouped-query heads grouped in verify passes.

Transformers' "sdpa" attention copies every layer's whole key and value cache to repeat the
KV heads (`repeat_kv`) whenever several query rows come with a mask: every verify block and
every draft tree, never a 1-token step. On the CPU that copy grows with the context (a 16-row
verify of the embedded target: 1.40 plain steps with "sdpa", 1.29 with this, in the
calibrations of `scripts/experiments/ab_loop_variants.py`; `scripts/experiments/torch_verify_cost.py --gqa` times them
at 300 and 1,500 tokens of context). PyTorch's CPU flash kernel takes the mask and `enable_gqa` together and gives the same
numbers bit for bit (`scripts/experiments/torch_verify_cost.py --gqa` compares), so this implementation,
registered under its own name, sends those passes there and everything else to "sdpa" as it is.
`install(model)` registers it with Transformers and switches the model to it; `uninstall()`
switches the model back and, with the last install, takes the name out of the registries.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from dflash_local.accel import Installed

NAME = "cpu_gqa_sdpa"  # no "flash" in it: Transformers takes such names for flash kernels
_registered = 0  # live installs: the name stays registered while any model runs it


def cpu_gqa_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, attention_mask: torch.Tensor | None,
                         dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """Transformers' attention-function signature: (output [B, rows, heads, dim], no weights)."""
    groups = getattr(module, "num_key_value_groups", 1)
    if (attention_mask is None or query.shape[2] == 1 or groups == 1 or query.device.type != "cpu"
            or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                         dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def install(model) -> Installed:
    """Switch a CPU target loaded with "sdpa" to this implementation; falsy if it does not run
    it. Masks are built as for "sdpa" (the same mask function, registered under this name).
    Only text-only models switch: a multimodal wrapper's sub-models (vision towers) and some
    model code that tests for the name "sdpa" itself stay as Transformers made them."""
    config = model.config
    previous = getattr(config, "_attn_implementation", None)
    if model.device.type != "cpu" or previous != "sdpa" or getattr(config, "sub_configs", None):
        return Installed("torch_attention")
    _register()
    try:
        model.set_attn_implementation(NAME)
    except ValueError:  # a model Transformers will not switch: it keeps "sdpa"
        pass
    if config._attn_implementation != NAME:
        _unregister()
        return Installed("torch_attention")

    def uninstall() -> None:
        model.set_attn_implementation(previous)
        _unregister()

    return Installed("torch_attention", uninstall)


def _register() -> None:
    global _registered
    _registered += 1
    AttentionInterface.register(NAME, cpu_gqa_sdpa_forward)  # a name -> function map
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def _unregister() -> None:
    """Transformers has no unregister: its registries are class-level dicts (`_global_mapping`)."""
    global _registered
    _registered -= 1
    if _registered == 0:
        AttentionInterface._global_mapping.pop(NAME, None)
        AttentionMaskInterface._global_mapping.pop(NAME, None)
