"""The target's log-probabilities of the tokens a round committed, as OpenAI's `logprobs` reports.

They come from the logits the verify already computed: row r of a verify is the target's
prediction after row r, so a round that keeps the path [0, *path] predicts its committed tokens
from those rows, in order (the prefill's token from the prompt's last row). Values are
log_softmax of the raw logits, before temperature, top-k and top-p: the model's own
distribution, as vLLM reports by default, whether the token was sampled or greedy. Computed only
when a request asks (GenerationParams.logprobs), so the default path pays nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dflash_local.events import TokenLogprob


def token_logprobs(logits: np.ndarray, rows: Sequence[int], token_ids: Sequence[int],
                   top: int) -> tuple[TokenLogprob, ...]:
    """logits: [R, V], one row per verified row; token_ids[i] was predicted by row rows[i].
    Each token's log-probability and the `top` most probable tokens of its row, best first
    (ties by the lower id, so equal rows always list the same ids)."""
    assert len(rows) == len(token_ids), (len(rows), len(token_ids))
    picked = np.asarray(logits)[list(rows)].astype(np.float64)  # float32 logits, exact in float64
    peak = picked.max(axis=-1, keepdims=True)
    log_probs = picked - peak - np.log(np.exp(picked - peak).sum(axis=-1, keepdims=True))
    entries = []
    for row, token_id in zip(log_probs, token_ids):
        top_ids = _best(row, top)
        entries.append(TokenLogprob(float(row[token_id]), tuple(int(i) for i in top_ids),
                                    tuple(float(row[i]) for i in top_ids)))
    return tuple(entries)


def _best(row: np.ndarray, count: int) -> np.ndarray:
    if count <= 0:
        return np.empty(0, dtype=np.int64)
    count = min(count, row.shape[-1])
    kth = -np.partition(-row, count - 1)[count - 1]
    candidates = np.flatnonzero(row >= kth)  # every id tied with the k-th too
    order = np.lexsort((candidates, -row[candidates]))  # by logprob descending, then id
    return candidates[order][:count]
