"""Prompt lookup: a second proposal source for the speculative loop, free of any model pass.

Text that repeats its context (code edits, quotes, summaries, repeated names) continues the
way it went the last time the same few tokens appeared. `NgramIndex` remembers, for every
n-gram of length 1..max_ngram seen so far, where its latest continuation starts, updated as
tokens are committed (O(max_ngram) per token), and proposes the tokens that followed the
longest suffix of the text that occurred before. The loop verifies them like DFlash drafts
(acceptance.py), so output stays exactly the target's; planning/lookups.py decides per
round whether a lookup draft is expected to beat the drafter's block or a plain step.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_NGRAM = 3


@dataclass(frozen=True)
class LookupDraft:
    token_ids: tuple[int, ...]
    ngram: int  # length of the suffix that matched (1..max_ngram): longer matches are surer


class NgramIndex:
    def __init__(self, token_ids: list[int], max_ngram: int = DEFAULT_MAX_NGRAM):
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after it
        self.extend(token_ids)

    def extend(self, token_ids) -> None:
        for token_id in token_ids:
            end = len(self.tokens)  # the new token's index: it continues the n-grams before it
            for n in range(1, min(self.max_ngram, end) + 1):
                self._next[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(int(token_id))

    def propose(self, max_tokens: int) -> LookupDraft | None:
        """What followed the latest earlier occurrence of the longest matching suffix.

        A draft that reaches the end of the text goes on with its own tokens (an overlapping copy,
        as LZ77's): text repeating with a period shorter than max_tokens (a rule of dashes, a
        run of spaces, a list of repeated lines) is proposed as far as asked, not cut at one
        period."""
        if max_tokens < 1:
            return None
        end = len(self.tokens)
        for n in range(min(self.max_ngram, end), 0, -1):
            start = self._next.get(tuple(self.tokens[end - n :]))
            if start is not None:  # never the suffix itself: its continuation does not exist yet
                draft = self.tokens[start : start + max_tokens]
                while len(draft) < max_tokens:  # start < end: the draft's own tokens come first
                    draft.append(draft[len(draft) - (end - start)])
                return LookupDraft(tuple(draft), n)
        return None
