"""Streamed text deltas and the split of a round's text between its slices of tokens."""

from __future__ import annotations

import pytest

from dflash_local.detokenize import StreamDetokenizer


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
