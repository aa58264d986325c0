"""Incremental detokenization: text deltas for streamed token ids, never a split UTF-8 char."""

from __future__ import annotations

# OpenAI's harmony format (gpt-oss) writes a reply's structure in special tokens: its channels
# (analysis, final), tool calls and ends (openai/harmony, docs/format.md, "Special Tokens")
HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>",
                   "<|return|>", "<|call|>")


def speaks_harmony(tokenizer) -> bool:
    """Whether the tokenizer has harmony's structure tokens: then a reply's text keeps its
    special tokens, which the service splits into channels and calls (service/harmony.py)."""
    unknown = getattr(tokenizer, "unk_token_id", None)
    for marker in ("<|channel|>", "<|message|>", "<|call|>"):
        token_id = tokenizer.convert_tokens_to_ids(marker)
        if not isinstance(token_id, int) or token_id == unknown:
            return False
    return True


class StreamDetokenizer:
    """Decodes only a short window per step (prefix/read offsets), so a step costs O(window).
    Special tokens are dropped, except a harmony tokenizer's (speaks_harmony): its text is the
    markup the service parses; `keep_special`: kept for any tokenizer (a text's own pieces)."""

    def __init__(self, tokenizer, keep_special: bool = False):
        self._tokenizer = tokenizer
        self._skip_special = not (keep_special or speaks_harmony(tokenizer))
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def add(self, token_ids) -> str:
        self._ids.extend(token_ids)
        decode, skip = self._tokenizer.decode, self._skip_special
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip)
        full_text = decode(self._ids[self._prefix_offset :], skip_special_tokens=skip)
        if full_text.endswith("\ufffd"):
            return ""  # a multi-byte character is still incomplete: wait for its next token
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return delta

    def add_split(self, token_ids, cuts) -> tuple[str, list[int]]:
        """The delta for `token_ids`, fed slice by slice at the cuts (each slice's text out as
        soon as its characters are complete), and for each cut (a count of token_ids from the
        start) how many of the delta's characters the ids before it made. A character whose
        bytes a cut splits counts after the cut; text an earlier call held back (it ended inside
        a character) counts with the first ids, and a cut at 0 has made none."""
        window_start, base = self._prefix_offset, len(self._ids)
        prefix_ids = self._ids[window_start : self._read_offset]
        delta, start, chars, held = "", 0, [], []
        for index, end in enumerate((*cuts, len(token_ids))):
            if end > start:
                delta += self.add(token_ids[start:end])
                start = end
            if index == len(cuts):
                break
            if end == 0 or self._read_offset == len(self._ids):  # all text up to the cut is out
                chars.append(len(delta) if end else 0)
            else:  # `add` holds back a character the cut splits: decode up to the cut, below
                held.append(index)
                chars.append(end)
        if held:  # rare (multi-byte characters split across tokens): two decodes more
            decode, skip = self._tokenizer.decode, self._skip_special
            prefix_chars = len(decode(prefix_ids, skip_special_tokens=skip))
            for index in held:
                text = decode(self._ids[window_start : base + chars[index]], skip_special_tokens=skip)
                chars[index] = min(len(delta), max(0, len(text.rstrip("\ufffd")) - prefix_chars))
        return delta, chars


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE (GPT-2's scheme, and Llama 3's, Qwen's, SmolLM2's) writes each byte of a
    token as one printable character: the printable Latin-1 bytes as themselves, the other 68
    as chr(256 + n) in byte order. Character -> byte."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)}
    alphabet, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            alphabet[chr(byte)] = byte
        else:
            alphabet[chr(256 + shifted)] = byte
            shifted += 1
    return alphabet


BYTE_LEVEL_ALPHABET = _byte_level_alphabet()


def token_bytes(tokenizer, token_id: int, text: str) -> bytes:
    """The raw bytes of one token whose decode is `text`: where the tokenizer is byte-level,
    the token's own bytes (a token holding part of a multi-byte character decodes to "\\ufffd",
    its bytes are still the right ones); otherwise, or where those bytes do not read back as
    `text`, the UTF-8 of `text`."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str) and piece and all(char in BYTE_LEVEL_ALPHABET for char in piece):
        raw = bytes(BYTE_LEVEL_ALPHABET[char] for char in piece)
        if raw.decode("utf-8", errors="replace") == text:
            return raw
    return text.encode("utf-8")
