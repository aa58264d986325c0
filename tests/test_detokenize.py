"""Streamed text deltas and the split of a round's text between its slices of tokens."""

from __future__ import annotations

import pytest

from dflash_local.engines.detokenize import StreamDetokenizer, token_bytes


@pytest.fixture(scope="module")
def tokenizer(embedded_target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_target_dir)


def test_a_character_split_by_a_cut_counts_after_it(tokenizer):
    ids = tokenizer.encode("Say \U0001F600 twice", add_special_tokens=False)
    split_at = [i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd")]
    assert split_at, "the emoji should take several byte-level tokens"
    cut = split_at[0]
    detokenizer = StreamDetokenizer(tokenizer)
    first = detokenizer.add(ids[:1])
    delta, (before_cut, whole) = detokenizer.add_split(ids[1:], (cut - 1, len(ids) - 1))
    assert first + delta == tokenizer.decode(ids)
    assert whole == len(delta)
    assert "\U0001F600" not in delta[:before_cut] and delta[before_cut:].startswith("\U0001F600")
    assert delta[:before_cut] == tokenizer.decode(ids[:cut]).rstrip("\ufffd")[len(first):]


def test_a_slice_that_ends_inside_a_character_waits_for_the_next_call(tokenizer):
    ids = tokenizer.encode("ok then \U0001F600", add_special_tokens=False)
    end = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd"))
    detokenizer = StreamDetokenizer(tokenizer)
    out, chars = detokenizer.add_split(ids[:end], (1, end))
    assert out == tokenizer.decode(ids[:1])  # the first slice is out; the second waits
    assert chars == [len(out), len(out)]
    rest, _ = detokenizer.add_split(ids[end:], (0,))
    assert out + rest == tokenizer.decode(ids)


def test_token_bytes_are_the_tokens_own_even_inside_a_character(tokenizer):
    text = "naïve \U0001F600 <|im_end|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    strings = [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    assert any(string.endswith("\ufffd") for string in strings)  # the emoji is split
    pieces = [token_bytes(tokenizer, i, string) for i, string in zip(ids, strings)]
    assert b"".join(pieces) == text.encode("utf-8")
    assert all(piece == string.encode() for piece, string in zip(pieces, strings)
               if "\ufffd" not in string)


def test_token_bytes_of_a_tokenizer_that_is_not_byte_level_are_its_texts_utf8():
    class WordPiece:  # "##" marks a word's continuation: not bytes
        def convert_ids_to_tokens(self, token_id):
            return {0: "##ing", 1: "\u2581caf\u00e9"}[token_id]

    assert token_bytes(WordPiece(), 0, "ing") == b"ing"
    assert token_bytes(WordPiece(), 1, " café") == " café".encode()
