"""A legacy completion's prompt (POST /v1/completions): token ids run as given, no chat
template, and the prompt echoed back when the request asks, with each of its tokens' entries.

The echo's entries are the ones a reply's tokens get (logprob_entries.py), plus `text_offset`:
where the token's text starts in the echoed prompt. A text prompt is echoed as the client sent
it, special tokens' text included, and each token's offset follows its decoded piece; ids are
echoed decoded, and their offsets follow the same decoding. The first token has no logprob (nothing
comes before it); the others are the target's own, scored over the prompt
(engines/prompt_scores.py) on the worker's thread before the generation begins.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_local.engines.detokenize import StreamDetokenizer
from dflash_local.engines.interface import Engine
from dflash_local.events import GenerationParams
from dflash_local.service.logprob_entries import LogprobEntries


@dataclass(frozen=True)
class RawPrompt:
    ids: tuple[int, ...]
    text: str | None = None  # as the client sent it (None: it sent ids)
    echo: bool = False  # the reply begins with the prompt


@dataclass(frozen=True)
class PromptEcho:
    """The prompt as the reply's first chunk carries it."""

    text: str
    entries: tuple[dict, ...] = ()  # one per prompt token, when logprobs were asked


def prompt_echo(engine: Engine, prompt: RawPrompt, params: GenerationParams,
                entries: LogprobEntries | None) -> PromptEcho:
    """Blocking: scoring runs the target over the whole prompt. `entries`: the reply's, when
    the request asks logprobs (params.logprobs alternatives per token)."""
    text = prompt.text if prompt.text is not None else engine.decode(prompt.ids)
    if entries is None:
        return PromptEcho(text)
    ids = list(prompt.ids)
    scores = (None, *engine.score_prompt(ids, params.logprobs, params))
    offsets = token_offsets(engine.tokenizer, ids, prompt.text)
    return PromptEcho(text, tuple({**entries.entry(token_id, score), "text_offset": offset}
                                  for token_id, score, offset in zip(ids, scores, offsets, strict=True)))


def token_offsets(tokenizer, ids: list[int], text: str | None = None) -> list[int]:
    """Where each id's text starts in the echo, from the ids' pieces decoded once, so no
    tokenizer runs over the text again. `text`: the prompt as sent, whose tokens `ids` are
    (the engine's encode_raw): pieces keep special tokens' text, as the text has it, and a
    token the tokenizer added that the text lacks (a BOS) takes none of its characters.
    None: the ids decoded as a reply is."""
    special_ids = set(tokenizer.all_special_ids) if text is not None else set()
    detokenizer = StreamDetokenizer(tokenizer, keep_special=text is not None)
    offsets, offset = [], 0
    for token_id in ids:
        offsets.append(offset)
        piece = detokenizer.add([token_id])
        if token_id in special_ids and not text.startswith(piece, offset):
            continue
        offset += len(piece)
    return offsets
