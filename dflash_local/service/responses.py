"""OpenAI response shapes as dicts, plus our `dflash` objects.

Per chunk, `dflash` says what that step committed: `token_ids`, of which the first `accepted`
were drafts the target accepted (the last `copied` of them a prompt-lookup copy's, the others
the drafter's; the rest is the target's bonus/correction token), `drafted` proposals,
the `round` (0 = the prefill's token) and the `block_size` used. The final usage's `dflash`
holds the generation's totals: tau, tokens/s, drafted/accepted, the accepted-per-round histogram;
with tree drafts `drafted` counts every node and `draft_depth` only the longest paths' drafts,
the most that could have been accepted.
"""

from __future__ import annotations

import json
import time

from dflash_local.events import GenerationStats, StepEvent


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def step_dflash(event: StepEvent) -> dict:
    return {"token_ids": list(event.token_ids), "drafted": event.drafted,
            "draft_depth": event.draft_depth, "accepted": event.accepted, "accepted_chars": event.accepted_chars,
            "copied": event.copied, "copied_chars": event.copied_chars,
            "round": event.round_index, "block_size": event.block_size, "mode": event.mode}


def accepted_histogram(stats: GenerationStats) -> list[int]:
    """Index k = how many rounds committed k tokens (bonus included, as tau counts them)."""
    histogram = [0] * (max(stats.accepted_per_round, default=0) + 1)
    for committed in stats.accepted_per_round:
        histogram[committed] += 1
    return histogram


def usage(stats: GenerationStats, engine: str, block_size: int, speculative: bool,
          auto: bool = False) -> dict:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        # OpenAI's field: the prompt's tokens a kept prefix gave (prefix_cache.py)
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
        "dflash": {
            "tau": round(stats.tau, 4),
            "decode_tokens_per_s": round(stats.decode_tokens_per_s, 2),
            "prefill_tokens_per_s": round(stats.prefill_tokens_per_s, 2),
            "drafted": stats.drafted,
            "draft_depth": stats.draft_depth,
            "accepted": stats.accepted,
            "rounds": stats.rounds,
            "accepted_per_round": accepted_histogram(stats),
            "prefill_s": round(stats.prefill_s, 6),
            "prefill_tokens": stats.prefill_tokens,  # computed; the rest came from the cache
            "cached_tokens": stats.cached_tokens,
            "decode_s": round(stats.decode_s, 6),
            "engine": engine,
            "block_size": block_size,
            "speculative": speculative,
            "block_policy": "auto" if auto else "fixed",  # auto: block_size is the widest allowed
        },
    }


class ChunkWriter:
    """Builds the chat.completion.chunk payloads of one streamed response."""

    def __init__(self, job_id: str, model: str):
        self.job_id = job_id
        self.model = model
        self.created = int(time.time())
        self._sent_role = False

    def _base(self) -> dict:
        return {"id": self.job_id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model}

    def step(self, text: str, event: StepEvent, finish_reason: str | None,
             logprobs: list[dict] | None = None) -> dict:
        """`logprobs`: the entries of this chunk's text (service/logprobs.py), None unasked."""
        delta = {"content": text}
        if not self._sent_role:
            delta = {"role": "assistant", **delta}
            self._sent_role = True
        return {**self._base(), "choices": [{"index": 0, "delta": delta,
                                             "logprobs": logprobs_object(logprobs),
                                             "finish_reason": finish_reason}],
                "dflash": step_dflash(event)}

    def usage(self, usage_payload: dict) -> dict:
        return {**self._base(), "choices": [], "usage": usage_payload}


def logprobs_object(entries: list[dict] | None) -> dict | None:
    return None if entries is None else {"content": entries, "refusal": None}


def completion(job_id: str, model: str, text: str, finish_reason: str | None,
               usage_payload: dict, logprobs: list[dict] | None = None) -> dict:
    return {"id": job_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": logprobs_object(logprobs), "finish_reason": finish_reason}],
            "usage": usage_payload}
