"""llguidance's matcher as method/constraint.py's `Grammar`: one generation's position in a
compiled grammar, its masks as numpy booleans."""

from __future__ import annotations

import numpy as np


class LLGuidanceGrammar:
    """A matcher of its own (a copy of the compiled one) over a vocabulary of `vocab_size`
    tokens; `end_ids`: the tokenizer's end tokens, which the loop's stop tokens replace."""

    def __init__(self, matcher, vocab_size: int, end_ids: list[int]):
        self._matcher, self._vocab_size = matcher, vocab_size
        self._bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
        self._end_ids = [token for token in end_ids if token < vocab_size]
        self.busy_s = 0.0  # the loop's Guide adds the time it spends on this grammar

    def allowed(self) -> np.ndarray:
        if self._matcher.is_error():  # a limit hit mid-reply: nothing more can follow
            return np.zeros(self._vocab_size, dtype=bool)
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        allowed = np.unpackbits(self._bits.view(np.uint8), count=self._vocab_size,
                                bitorder="little").view(bool)
        allowed[self._end_ids] = False
        return allowed

    def complete(self) -> bool:
        return self._matcher.is_accepting()

    def consume(self, token_id: int) -> None:
        # a refused token leaves the matcher in its error state: `allowed` then admits nothing
        self._matcher.consume_token(token_id)

    def rollback(self, count: int) -> None:
        if count and not self._matcher.rollback(count):
            raise RuntimeError(f"the grammar could not roll back {count} tokens: "
                               f"{self._matcher.get_error()}")

    def forced(self) -> list[int]:
        return [] if self._matcher.is_error() else self._matcher.compute_ff_tokens()
