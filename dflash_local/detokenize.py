"""Incremental detokenization: text deltas for streamed token ids, never a split UTF-8 char."""

from __future__ import annotations


class StreamDetokenizer:
    """Decodes only a short window per step (prefix/read offsets), so a step costs O(window)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def add(self, token_ids) -> str:
        self._ids.extend(token_ids)
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=True)
        full_text = decode(self._ids[self._prefix_offset :], skip_special_tokens=True)
        if full_text.endswith("\ufffd"):
            return ""  # a multi-byte character is still incomplete: wait for its next token
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return delta
