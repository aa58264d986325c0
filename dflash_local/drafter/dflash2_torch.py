"""What DFlash 2 adds to the PyTorch drafter (model_torch.py), with z-lab's weight names.

- `GroupedCausalConv` wraps a layer's attention and its MLP: before the sublayer (`prepare`) and
  after it (`finish`), each row of the block becomes a causal mix of itself and the K - 1 rows
  before it in the block, per channel through a learned base kernel and per group of channels
  through a kernel each row computes from its own input.
- `CandidateSelector` holds the selector's weights; `selector_inputs` gathers what one round's
  selection needs (selector.py holds the rule).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dflash_local.drafter.config import DFlash2Config
from dflash_local.drafter.selector import SelectorInputs


def grouped_causal_conv(hidden: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor,
                        group_size: int, block: int | None = None) -> torch.Tensor:
    """hidden [b, L, H]; dynamic [b, L, K, G] (one weight per row, offset and channel group);
    base [K, H]. Row j: sum over offsets o < K of (base[o] + dynamic[j, o]) * hidden[j - o], rows
    before the block's first counting as zeros (a block may be shorter than the kernel).
    `block`: the L rows are blocks of this many packed one after another (training), each its
    own sequence."""
    if block is not None:
        shape = hidden.shape
        mixed = grouped_causal_conv(hidden.reshape(-1, block, shape[-1]),
                                    dynamic.reshape(-1, block, *dynamic.shape[-2:]), base, group_size)
        return mixed.view(shape)
    batch, length, hidden_size = hidden.shape
    groups = hidden_size // group_size
    rows = hidden.view(batch, length, groups, group_size)
    out = torch.zeros_like(rows)
    for offset in range(min(base.shape[0], length)):
        shifted = rows if offset == 0 else F.pad(rows[:, :-offset], (0, 0, 0, 0, offset, 0))
        out = out + base[offset].view(1, 1, groups, group_size) * shifted
        out = out + dynamic[:, :, offset, :, None] * shifted
    return out.view_as(hidden)


class GroupedCausalConv(nn.Module):
    def __init__(self, hidden_size: int, sizes: DFlash2Config):
        super().__init__()
        self.kernel_size, self.group_size = sizes.conv_kernel_size, sizes.conv_group_size
        groups = hidden_size // sizes.conv_group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, self.kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * self.kernel_size * groups, bias=False)

    def prepare(self, hidden: torch.Tensor, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the sublayer's input, convolved; the kernel `finish` uses), both from `hidden`."""
        dynamic = self.kernel_projection(hidden).view(*hidden.shape[:-1], 2, self.kernel_size, -1)
        mixed = grouped_causal_conv(hidden, dynamic[..., 0, :, :], self.base_kernel[0], self.group_size,
                                    block)
        return mixed, dynamic[..., 1, :, :]

    def finish(self, out: torch.Tensor, dynamic: torch.Tensor, block: int | None = None) -> torch.Tensor:
        return grouped_causal_conv(out, dynamic, self.base_kernel[1], self.group_size, block)

    @torch.no_grad()
    def become_identity(self) -> None:
        """Pass rows through unchanged (offset 0 weighs 1, nothing dynamic): a v1 drafter's
        layers are a DFlash 2 drafter's with these convolutions."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()


class CandidateSelector(nn.Module):
    """The codebooks are plain parameters: the checkpoint stores them without `.weight`."""

    def __init__(self, hidden_size: int, vocab_size: int, sizes: DFlash2Config):
        super().__init__()
        self.top_k = sizes.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, sizes.selector_rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, sizes.selector_rank))
        self.hidden_projection = nn.Linear(hidden_size, sizes.selector_rank, bias=False)

    @torch.no_grad()
    def start_neutral(self, generator: torch.Generator | None = None) -> None:
        """Near-neutral, so the drafter's own logits choose at first, yet trainable (all-zero
        codebooks would pass no gradient to each other)."""
        for weight in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
            weight.normal_(0.0, 0.02, generator=generator)

    def training_scores(self, hidden: torch.Tensor, logits: torch.Tensor, vocab_ids: torch.Tensor | None,
                        gold: torch.Tensor, previous_ids: torch.Tensor, force_gold: bool = True):
        """Teacher-forced selection: the scores [b, Q, K] of each position's top-K columns, each
        after the gold token before it (`previous_ids`); their token ids; the gold's index. For
        training (`force_gold`) the gold column is always a candidate (in place of the K-th where
        the drafter ranked it lower); unforced, the scores are those drafting would see.
        gold: [b, Q] logits columns (-100: none, any index then)."""
        columns = logits.detach().topk(min(self.top_k, logits.shape[-1]), dim=-1).indices
        wanted = gold.clamp(min=0)[..., None]
        if force_gold:
            present = (columns == wanted).any(-1, keepdim=True)
            columns = torch.cat([columns[..., :-1], torch.where(present, columns[..., -1:], wanted)], dim=-1)
        ids = columns if vocab_ids is None else vocab_ids[columns]
        code = self.predecessor_codebook[previous_ids] * self.hidden_projection(hidden)
        scores = logits.gather(-1, columns) + torch.einsum("bqr,bqkr->bqk", code, self.successor_codebook[ids])
        return scores, ids, (columns == wanted).int().argmax(-1)

    @torch.inference_mode()
    def inputs(self, hidden: torch.Tensor, logits: torch.Tensor, vocab_ids: torch.Tensor | None,
               anchor_id: int) -> SelectorInputs:
        """hidden [D, H] and logits [D, V'] of the block's positions after the anchor; vocab_ids
        maps a logits column to its token id (a restricted draft vocabulary; None: the column)."""
        unary, columns = torch.topk(logits, min(self.top_k, logits.shape[-1]), dim=-1)
        candidates = columns if vocab_ids is None else vocab_ids[columns]
        anchor = torch.tensor(anchor_id, device=candidates.device)
        return SelectorInputs(
            unary=_numpy(unary), candidates=candidates.cpu().numpy(),
            hidden=_numpy(self.hidden_projection(hidden)),
            anchor_code=_numpy(self.predecessor_codebook[anchor]),
            predecessor=_numpy(self.predecessor_codebook[candidates]),
            successor=_numpy(self.successor_codebook[candidates]))


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.float().cpu().numpy()
