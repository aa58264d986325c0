"""Training batches: random anchors per sequence, blocks of anchor + MASKs, block-sparse mask.

Each block sees the target's taps strictly before its anchor plus its own block (both ways),
never another block; all blocks of a sequence are packed into one forward pass.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch


@dataclass
class Batch:
    taps: torch.Tensor  # [b, S, taps*H] context rows at positions 0..S-1
    block_ids: torch.Tensor  # [b, Q] anchor + MASK ids, Q = anchors * B
    block_pos: torch.Tensor  # [b, Q] absolute positions
    mask: torch.Tensor  # [b, 1, Q, S+Q] bool, True = may attend
    labels: torch.Tensor  # [b, Q] target tokens (-100 = no loss)
    weights: torch.Tensor  # [b, Q] exp(-(k-1)/gamma) on block positions 1..B-1, else 0


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[B]: 0 for the anchor, exp(-(k-1)/gamma) for block position k >= 1."""
    weights = [0.0] + [math.exp(-(k - 1) / gamma) for k in range(1, block_size)]
    return torch.tensor(weights)


def valid_anchors(sequence: dict) -> range:
    """Anchors in the response: from the last prompt token to the second-to-last token."""
    return range(max(1, sequence["prompt_len"] - 1), len(sequence["tokens"]) - 1)


def make_batch(sequences: list[dict], anchors_per_seq: int, block_size: int, mask_token_id: int,
               gamma: float, rng: random.Random) -> Batch:
    count, queries = len(sequences), anchors_per_seq * block_size
    ctx_len = max(len(s["tokens"]) - 1 for s in sequences)
    hidden = sequences[0]["taps"].shape[-1]
    taps = torch.zeros(count, ctx_len, hidden)
    block_ids = torch.full((count, queries), mask_token_id, dtype=torch.long)
    block_pos = torch.zeros(count, queries, dtype=torch.long)
    labels = torch.full((count, queries), -100, dtype=torch.long)
    weights = torch.zeros(count, queries)
    mask = torch.zeros(count, 1, queries, ctx_len + queries, dtype=torch.bool)
    offsets = torch.arange(block_size)
    pos_weights = position_weights(block_size, gamma)
    same_block = torch.block_diag(*[torch.ones(block_size, block_size, dtype=torch.bool)] * anchors_per_seq)
    for row, sequence in enumerate(sequences):
        tokens = sequence["tokens"].long()
        taps[row, : len(sequence["taps"])] = sequence["taps"].float()
        candidates = list(valid_anchors(sequence))
        anchors = rng.sample(candidates, min(anchors_per_seq, len(candidates)))
        mask[row, 0, :, ctx_len:] = same_block
        for index, anchor in enumerate(sorted(anchors)):
            cols = slice(index * block_size, (index + 1) * block_size)
            block_ids[row, cols.start] = tokens[anchor]
            positions = anchor + offsets
            block_pos[row, cols] = positions
            in_range = positions < len(tokens)
            labels[row, cols] = torch.where(in_range, tokens[positions.clamp(max=len(tokens) - 1)], -100)
            weights[row, cols] = pos_weights * in_range
            mask[row, 0, cols, :anchor] = True  # context strictly before the anchor
    return Batch(taps, block_ids, block_pos, mask, labels, weights)
