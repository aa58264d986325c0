"""OpenAI's `logprobs.content` entries of a reply, each sent with the chunk that carries its text.

The engine gives every committed token a TokenLogprob (method/logprobs.py); here each becomes
{token, logprob, bytes, top_logprobs}, where a token's string is the tokenizer's decode of that
one id (special tokens by their markup) and `bytes` the token's own bytes (detokenize.py).
A chunk's text is not always its round's tokens' text: the detokenizer holds a split multi-byte
character back and the stop matcher a tail that could begin a stop string. So each token's place
in the reply's text is tracked (a detokenizer fed one token at a time), and its entry goes out
once all its text has. At the end, tokens whose text a stop string cut away go with their text,
and so does the end-of-turn token that ended the reply (its text is not in the content either).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from dflash_local.engines.detokenize import StreamDetokenizer, token_bytes
from dflash_local.events import StepEvent, TokenLogprob


@dataclass(frozen=True)
class _Placed:
    start: int  # characters of the reply's text before this token's
    end: int  # ... once its own are in (= start: it made none, or its character is not whole yet)
    entry: dict


class LogprobEntries:
    """One reply's entries, handed out in step with the text actually sent."""

    def __init__(self, tokenizer, completions: bool = False):
        """`completions`: legacy completions' entries: each also says where its text starts in
        the reply's (`text_offset`), and the end-of-turn token that ended the reply keeps its
        entry, as vLLM reports it (lm-eval's loglikelihood counts on the generated one)."""
        self._tokenizer = tokenizer
        self._completions = completions
        self._text = StreamDetokenizer(tokenizer)
        self._made = 0  # characters the tokens so far made
        self._sent = 0  # characters sent to the client
        self._waiting: deque[_Placed] = deque()
        self._strings: dict[int, tuple[str, list[int]]] = {}  # id -> (token, bytes)

    def take(self, event: StepEvent, sent_text: str, finish: str | None,
             cut_by_stop: bool) -> list[dict]:
        """The entries to send with a chunk of `sent_text`, for `event`'s tokens and any held.
        `finish`: the reply ends here; `cut_by_stop`: a stop string ended it."""
        for token_id, logprob in zip(event.token_ids, event.logprobs, strict=True):
            start = self._made
            self._made += len(self._text.add([token_id]))
            entry = self.entry(token_id, logprob)
            if self._completions:
                entry["text_offset"] = start
            self._waiting.append(_Placed(start, self._made, entry))
        self._sent += len(sent_text)
        if not finish:
            ready = []
            while self._waiting and self._waiting[0].end <= self._sent:
                ready.append(self._waiting.popleft().entry)
            return ready
        if event.finish_reason == "stop" and not cut_by_stop and not self._completions:
            self._waiting.pop()  # the end-of-turn token
        if cut_by_stop:
            return [placed.entry for placed in self._waiting if placed.start < self._sent]
        return [placed.entry for placed in self._waiting]

    def entry(self, token_id: int, logprob: TokenLogprob | None) -> dict:
        """One token's entry; `logprob` None for a prompt's first token (nothing predicts it)."""
        if logprob is None:
            return {**self._described(token_id, None), "top_logprobs": None}
        top = [self._described(top_id, value)
               for top_id, value in zip(logprob.top_ids, logprob.top_logprobs, strict=True)]
        return {**self._described(token_id, logprob.logprob), "top_logprobs": top}

    def _described(self, token_id: int, logprob: float | None) -> dict:
        described = self._strings.get(token_id)
        if described is None:
            token = self._tokenizer.decode([token_id], skip_special_tokens=False)
            described = (token, list(token_bytes(self._tokenizer, token_id, token)))
            self._strings[token_id] = described
        token, raw = described
        return {"token": token, "logprob": logprob, "bytes": raw}
