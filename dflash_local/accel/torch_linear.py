"""Linear layers with their weights reordered once for oneDNN: CPU float32 inference.

Stock `nn.Linear` on a CPU goes to MKL: a 1-row GEMV streams the weight once, but with 2-16 rows
(a verify block, a draft block) MKL's GEMM repacks the whole weight on every call, so a verify
pass of width 2 cost 1.7-2.0x and of width 16 2.1-2.2x a 1-token step on the embedded target. With the
weight reordered once at load for up to `rows_hint` rows, oneDNN's kernel costs about the same
for 1 to 16 rows, and a row's result does not depend on how many rows came with it (the verify
rows equal plain decoding's bit for bit in these layers). Measured: scripts/experiments/torch_verify_cost.py.

The reordered weight replaces the original (no second copy), except where the weight is shared
with another module (a tied LM head keeps the embedding table alive anyway). `install(model)`
packs a model's linears; `uninstall()` puts `nn.Linear`s back, their weights read out of the
packed ones (exactly: an identity matrix through the kernel), which costs a matmul of
in_features^2 x out_features per layer: an engine releases its packed model as it is instead.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_local.accel import Installed

DEFAULT_ROWS_HINT = 16  # z-lab's block size; more rows still compute right, a little slower


def packing_available() -> bool:
    """oneDNN present, with the (private, inductor) ops this module uses: checked on torch 2.13."""
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """`nn.Linear` inference on a oneDNN-reordered weight (float32, CPU, no autograd)."""

    def __init__(self, linear: nn.Linear, rows_hint: int, keep_weight: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows_hint)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        if keep_weight:  # a tied head's weight is the embedding table: the same object, no copy
            self.weight = linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        out = torch.ops.mkldnn._linear_pointwise(rows, self._packed, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)

    @torch.no_grad()
    def unpacked(self) -> nn.Linear:
        """An `nn.Linear` with this layer's weight and bias (row i of I x W^T is column i of W^T)."""
        weight = getattr(self, "weight", None)
        if weight is None:
            identity = torch.eye(self.in_features, dtype=torch.float32)
            weight = torch.ops.mkldnn._linear_pointwise(identity, self._packed, None, "none", [], "").T
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight.contiguous())
        if self.bias is not None:
            linear.bias = nn.Parameter(self.bias.detach().clone())
        return linear

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN-packed"


def pack_linears(model: nn.Module, rows_hint: int, shared: tuple[torch.Tensor, ...] = ()) -> int:
    """Replace each float32 CPU `nn.Linear` under `model` in place; returns how many.

    `shared`: weights other modules also use (a tied embedding table); a layer holding one of
    them keeps it reachable as `.weight`.
    """
    return len(_pack(model, rows_hint, shared))


def install(model: nn.Module, rows_hint: int, shared: tuple[torch.Tensor, ...] = ()) -> Installed:
    """`pack_linears`, with a way back; falsy when nothing was packed."""
    slots = _pack(model, rows_hint, shared)
    if not slots:
        return Installed("torch_linear")

    def uninstall() -> None:
        for parent, name in slots:
            setattr(parent, name, getattr(parent, name).unpacked())

    return Installed("torch_linear", uninstall)


def _pack(model: nn.Module, rows_hint: int, shared: tuple[torch.Tensor, ...]) -> list[tuple[nn.Module, str]]:
    """The (parent, name) slots whose linears were packed."""
    if not packing_available():
        return []
    shared_ids = {id(w) for w in shared}
    # names, not modules: each original is freed as soon as it is replaced (peak memory = the
    # model plus one layer, not two models)
    slots = [(parent, name) for parent in model.modules() for name, child in parent.named_children()
             if _packable(child)]
    for parent, name in slots:
        child = getattr(parent, name)
        setattr(parent, name, PackedLinear(child, rows_hint, keep_weight=id(child.weight) in shared_ids))
        del child
    if slots:
        _copy_out_of_checkpoint_map(model)
    return slots


def pack_linear(linear: nn.Linear, rows_hint: int) -> nn.Module:
    """One layer: packed if it can be (float32 on a CPU with oneDNN), else itself."""
    return PackedLinear(linear, rows_hint) if packing_available() and _packable(linear) else linear


def _packable(module: nn.Module) -> bool:
    return (type(module) is nn.Linear and module.weight.device.type == "cpu"
            and module.weight.dtype == torch.float32)


def pack_causal_lm(model: nn.Module, rows_hint: int = DEFAULT_ROWS_HINT) -> int:
    """`pack_linears` for a Transformers causal LM: its input embedding table may be its tied head."""
    return pack_linears(model, rows_hint, shared=(model.get_input_embeddings().weight,))


def install_causal_lm(model: nn.Module, rows_hint: int = DEFAULT_ROWS_HINT) -> Installed:
    """`install` for a Transformers causal LM (its tied head's table stays shared)."""
    return install(model, rows_hint, shared=(model.get_input_embeddings().weight,))


def _copy_out_of_checkpoint_map(model: nn.Module) -> None:
    """Give the remaining parameters (embeddings, norms) their own memory.

    Transformers maps a float32 safetensors file and its tensors view that map: while one of them
    does, the whole file stays mapped, and the pages of the weights just packed and released stay
    counted in the process (+0.5 GB for the embedded target). One tensor at a time, so the
    transient is the largest one (the embedding table); a converted (bf16 -> fp32) checkpoint was
    never mapped and pays that copy for nothing.
    """
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.data = parameter.data.clone()
