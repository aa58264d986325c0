"""What DFlash 2 adds to the MLX drafter, with the checkpoint's own weight names.

Boundary: the grouped dynamic causal convolution that wraps each layer's attention and MLP
(`attention_conv`, `mlp_conv`), and the candidate selector's weights with the gathering of one
round's `SelectorInputs`; the selector's rule itself is drafter/selector.py (numpy, shared by
the engines). model_mlx.py builds the layers and the session from these pieces.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx import nn

from dflash_local.drafter.config import DFlash2Config
from dflash_local.drafter.selector import SelectorInputs


def causal_convolve(rows: mx.array, base: mx.array, dynamic: mx.array, group_size: int) -> mx.array:
    """Each block row mixed with the K-1 rows before it, channel-wise:

        out[j] = sum_{o < K} (base[o] + dynamic[j, o, group of the channel]) * rows[j - o]

    rows: [b, t, H]; base: [K, H]; dynamic: [b, t, K, H // group_size]. Rows before the block's
    first are zeros, so any t >= 1 works (a block shorter than the kernel included).
    """
    batch, length, hidden = rows.shape
    kernel_size, groups = base.shape[0], hidden // group_size
    # one dynamic weight per group, the same for the group_size channels of the group
    dynamic = mx.repeat(dynamic.reshape(batch, length, kernel_size, groups, 1), group_size, axis=-1)
    dynamic = dynamic.reshape(batch, length, kernel_size, hidden)
    weights = base.astype(rows.dtype)[None, None] + dynamic  # [b, t, K, H]
    out = weights[:, :, 0] * rows
    for offset in range(1, min(kernel_size, length)):  # larger offsets only reach zero rows
        earlier = mx.concatenate([mx.zeros((batch, offset, hidden), rows.dtype), rows[:, :-offset]],
                                 axis=1)
        out = out + weights[:, :, offset] * earlier
    return out


class GroupedDynamicCausalConv(nn.Module):
    """A sublayer's convolution along the block: `prepare` mixes its input with base_kernel[0]
    and the first dynamic kernel, `finish` mixes its output with base_kernel[1] and the second;
    both dynamic kernels are projected from the sublayer's input rows."""

    def __init__(self, hidden_size: int, sizes: DFlash2Config):
        super().__init__()
        self.kernel_size, self.group_size = sizes.conv_kernel_size, sizes.conv_group_size
        groups = hidden_size // self.group_size
        self.base_kernel = mx.zeros((2, self.kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * self.kernel_size * groups, bias=False)

    def prepare(self, rows: mx.array) -> tuple[mx.array, mx.array]:
        """(the sublayer's input, the kernel `finish` needs); rows: [b, t, H]."""
        batch, length, _ = rows.shape
        dynamic = self.kernel_projection(rows).reshape(batch, length, 2, self.kernel_size, -1)
        mixed = causal_convolve(rows, self.base_kernel[0], dynamic[:, :, 0], self.group_size)
        return mixed, dynamic[:, :, 1]

    def finish(self, out: mx.array, kernel: mx.array) -> mx.array:
        return causal_convolve(out, self.base_kernel[1], kernel, self.group_size)


class PassThrough:
    """A v1 layer's stand-in for the convolutions: the sublayer sees and returns its rows as
    they are."""

    @staticmethod
    def prepare(rows: mx.array) -> tuple[mx.array, None]:
        return rows, None

    @staticmethod
    def finish(out: mx.array, kernel: None) -> mx.array:
        return out


PASS_THROUGH = PassThrough()


class CandidateSelector(nn.Module):
    """The selector's weights. The codebooks are plain [vocab, rank] arrays because the
    checkpoint stores them without `.weight`: their names load with no map."""

    def __init__(self, hidden_size: int, vocab_size: int, sizes: DFlash2Config):
        super().__init__()
        self.top_k = sizes.selector_top_k
        self.predecessor_codebook = mx.zeros((vocab_size, sizes.selector_rank))
        self.successor_codebook = mx.zeros((vocab_size, sizes.selector_rank))
        self.hidden_projection = nn.Linear(hidden_size, sizes.selector_rank, bias=False)

    def inputs(self, anchor_id: int, hidden: mx.array, logits: mx.array,
               token_ids: mx.array | None) -> SelectorInputs:
        """One round's inputs for D positions. hidden: [D, H] the drafter's final-normed states;
        logits: [D, V'] over the draft vocabulary, whose ids are `token_ids` ([V'], None: the
        whole vocabulary). Candidates are each position's top-K, best first."""
        top_k = min(self.top_k, logits.shape[-1])
        best = mx.argpartition(-logits, top_k - 1, axis=-1)[:, :top_k]
        unary = mx.take_along_axis(logits, best, axis=-1)
        order = mx.argsort(-unary, axis=-1)
        best = mx.take_along_axis(best, order, axis=-1)
        unary = mx.take_along_axis(unary, order, axis=-1)
        candidates = best if token_ids is None else mx.take(token_ids, best)
        codes = (self.hidden_projection(hidden), self.predecessor_codebook[anchor_id],
                 self.predecessor_codebook[candidates], self.successor_codebook[candidates])
        mx.eval(unary, candidates, *codes)
        projected, anchor_code, predecessor, successor = (
            np.array(code.astype(mx.float32)) for code in codes)
        return SelectorInputs(
            unary=np.array(unary.astype(mx.float32)), candidates=np.array(candidates),
            hidden=projected, anchor_code=anchor_code, predecessor=predecessor, successor=successor,
        )
