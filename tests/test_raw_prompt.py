"""A legacy completion's echoed prompt (service/raw_prompt.py): each token's text_offset, on
the embedded SmolLM2 tokenizer, from the ids alone: the tokenizer never runs over the text
again (a Python tokenizer has no offset mapping to give)."""

from __future__ import annotations

import pytest

from dflash_local.service.raw_prompt import token_offsets

TEXTS = ["Once upon a time", "Hi<|im_end|> there", "  two  spaces\n\nand lines\t",
         "naïve café: 你好, 世界 🙂🚀 done", "<|im_start|>user\nx<|im_end|>"]


class NoTextTokenizing:
    """The real tokenizer, refusing to tokenize text (as a tokenizer without offsets would)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, *args, **kwargs):
        raise AssertionError("the text was tokenized again")

    encode = __call__

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.fixture(scope="module")
def tokenizer(embedded_target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(embedded_target_dir))


@pytest.mark.parametrize("text", TEXTS)
def test_a_text_prompts_offsets_match_its_text(tokenizer, text):
    """Each token starts where the ids before it, decoded whole, end in the text (a character
    whose bytes two tokens share starts at the first)."""
    ids = tokenizer.encode(text, add_special_tokens=True)
    offsets = token_offsets(NoTextTokenizing(tokenizer), ids, text)
    assert len(offsets) == len(ids)
    for position, offset in enumerate(offsets):
        before = tokenizer.decode(ids[:position], skip_special_tokens=False).rstrip("\ufffd")
        assert text.startswith(before) and offset == len(before)
    last = tokenizer.decode(ids[-1:], skip_special_tokens=False)
    assert text[offsets[-1]:] == last  # and the last token's text ends the prompt


def test_an_ids_prompts_offsets_follow_its_decoded_text(tokenizer):
    """Ids are echoed decoded as a reply is (special tokens dropped): offsets index that text."""
    ids = tokenizer.encode(TEXTS[1] + TEXTS[3], add_special_tokens=True)
    offsets = token_offsets(NoTextTokenizing(tokenizer), ids)
    for position, offset in enumerate(offsets):
        assert offset == len(tokenizer.decode(ids[:position], skip_special_tokens=True).rstrip("\ufffd"))
