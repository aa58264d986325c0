"""A legacy completion's prompt (POST /v1/completions): token ids run as given, no chat
template, and the prompt echoed back when the request asks, with each of its tokens' entries.

The echo's entries are the ones a reply's tokens get (logprob_entries.py), plus `text_offset`:
where the token's text starts in the echoed prompt. A text prompt is echoed as the client sent
it, special tokens' text included, so its offsets are the tokenizer's own character spans; ids
are echoed decoded, and their offsets follow the same decoding. The first token has no logprob (nothing
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
    offsets = (text_offsets(engine.tokenizer, prompt.text) if prompt.text is not None
               else decoded_offsets(engine.tokenizer, ids))
    return PromptEcho(text, tuple({**entries.entry(token_id, score), "text_offset": offset}
                                  for token_id, score, offset in zip(ids, scores, offsets, strict=True)))


def text_offsets(tokenizer, text: str) -> list[int]:
    """Where each of text's tokens (as the engine's encode_raw makes them) starts in it: where
    the one before it ended (a span's start may skip the space a token begins with)."""
    spans = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)["offset_mapping"]
    return [0, *(end for _start, end in spans[:-1])]


def decoded_offsets(tokenizer, ids: list[int]) -> list[int]:
    """Where each id's text starts in the ids decoded as a reply is."""
    detokenizer, offsets, offset = StreamDetokenizer(tokenizer), [], 0
    for token_id in ids:
        offsets.append(offset)
        offset += len(detokenizer.add([token_id]))
    return offsets
