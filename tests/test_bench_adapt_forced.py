"""The adaptation scripts' teacher-forced τ (bench/adapt_forced.py): all of a sequence's taps in
one pass of the teacher's chunked generator, and τ as 1 + the mean accepted drafts over blocks at
the asked number of evenly spaced anchors."""

from __future__ import annotations

import pytest

from dflash_local.bench.adapt_forced import every_fourth_block, forced_tau, with_taps


class ChunkedTeacher:
    """A teacher whose taps come in three chunks, the rows numbered."""

    def taps(self, tokens, chunk_rows):
        for _ in range(3):
            yield
        return list(range(len(tokens) - 1))


class ScriptedTrainer:
    """Accepts `accepted` drafts at every anchor; keeps the anchors it was asked about."""

    def __init__(self, accepted: int):
        self.accepted_each = accepted
        self.asked: list[list[int]] = []

    def accepted(self, state, sequence, anchors):
        self.asked.append(anchors)
        return [self.accepted_each] * len(anchors)


def a_sequence(prompt_len: int, reply_len: int) -> dict:
    return {"tokens": list(range(prompt_len + reply_len)), "prompt_len": prompt_len}


def test_all_the_taps_come_back_and_the_sequence_is_not_changed():
    sequence = a_sequence(4, 6)
    tapped = with_taps(ChunkedTeacher(), sequence)
    assert tapped["taps"] == list(range(9)) and "taps" not in sequence


@pytest.mark.parametrize("accepted", [0, 3])
def test_tau_is_one_plus_the_mean_accepted_at_the_asked_anchors(accepted):
    trainer = ScriptedTrainer(accepted)
    sequences = [a_sequence(8, 32), a_sequence(8, 64)]
    assert forced_tau(trainer, None, sequences, every_fourth_block) == 1 + accepted
    assert [len(anchors) for anchors in trainer.asked] == [8, 16]
    forced_tau(trainer, None, sequences)  # 32 anchors a reply, as many as it has
    assert [len(anchors) for anchors in trainer.asked[2:]] == [32, 32]
