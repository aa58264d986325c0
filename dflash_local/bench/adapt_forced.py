"""Teacher-forced τ for the adaptation scripts (scripts/adapt_tune.py, adapt_idle_measure.py): a
recorded reply as a training sequence with all its taps at once, and the drafts greedy
verification would accept on it with given drafter weights.

Boundary: measurement outside the service; adapt/idle.py taps and scores its rounds in slices.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable


def with_taps(teacher, sequence: dict) -> dict:
    """A copy of the training sequence with the target's taps of all its rows (one pass)."""
    chunks = teacher.taps(sequence["tokens"], lambda: 512)
    while True:
        try:
            next(chunks)
        except StopIteration as done:
            return dict(sequence, taps=done.value)


def tapped_replies(teacher, settings, replies) -> list[dict]:
    """(prompt ids, reply ids) pairs as tapped training sequences, cut as adapt/trainer cuts them."""
    from dflash_local.adapt.trainer import training_sequence

    return [with_taps(teacher, training_sequence(prompt_ids, reply_ids, settings))
            for prompt_ids, reply_ids in replies]


def every_fourth_block(sequence: dict) -> int:
    """An anchor count: one block per four reply tokens."""
    return max(1, (len(sequence["tokens"]) - sequence["prompt_len"]) // 4)


def forced_tau(trainer, state: dict | None, sequences: list[dict],
               anchors_of: Callable[[dict], int] = lambda sequence: 32) -> float:
    """1 + the mean accepted drafts per block, blocks at `anchors_of(sequence)` evenly spaced
    anchors of each tapped sequence, with the weights `state` (None: the candidate)."""
    from dflash_local.adapt.idle import evenly_spaced

    accepted: list[int] = []
    for sequence in sequences:
        accepted += trainer.accepted(state, sequence, evenly_spaced(sequence, anchors_of(sequence)))
    return 1 + statistics.fmean(accepted)
