"""OpenAI response shapes as dicts, plus our `dflash` objects.

Per chunk, `dflash` says what that step committed: `token_ids`, of which the first `accepted`
were drafts the target accepted (the last `copied` of them a prompt-lookup draft's, the others
the drafter's; the rest is the target's bonus/correction token), `drafted` proposals,
the `round` (0 = the prefill's token) and the round's width as `block_size`. The final usage's `dflash`
holds the generation's totals: tau, tokens/s, drafted/accepted, the accepted-per-round histogram;
with tree drafts `drafted` counts every node and `draft_depth` only the longest paths' drafts,
the most that could have been accepted.
"""

from __future__ import annotations

import json
import time

from dflash_local.events import GenerationStats, StepEvent
from dflash_local.service.worker import ToolCallDelta


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def named_sse(payload: dict) -> bytes:
    """An event named by its payload's `type` (Anthropic's and the Responses API's streams)."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


def step_dflash(event: StepEvent) -> dict:
    return {"token_ids": list(event.token_ids), "drafted": event.drafted,
            "draft_depth": event.draft_depth, "accepted": event.accepted, "accepted_chars": event.accepted_chars,
            "copied": event.lookup_accepted, "copied_chars": event.lookup_accepted_chars,
            "round": event.round_index, "block_size": event.width, "mode": event.mode}


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
             logprobs: list[dict] | None = None,
             tool_calls: tuple[ToolCallDelta, ...] = (), reasoning: str = "") -> dict:
        """`logprobs`: the entries of this chunk's text (service/logprobs.py), None unasked;
        `reasoning`: a harmony target's analysis text, as vLLM's `reasoning_content`."""
        delta = {"content": text if text or not (tool_calls or reasoning) else None}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if tool_calls:
            delta["tool_calls"] = [tool_call_delta(piece) for piece in tool_calls]
        if not self._sent_role:
            delta = {"role": "assistant", **delta}
            self._sent_role = True
        return {**self._base(), "choices": [{"index": 0, "delta": delta,
                                             "logprobs": logprobs_object(logprobs),
                                             "finish_reason": finish_reason}],
                "dflash": step_dflash(event)}

    def usage(self, usage_payload: dict) -> dict:
        return {**self._base(), "choices": [], "usage": usage_payload}


def tool_call_delta(piece: ToolCallDelta) -> dict:
    """OpenAI's streamed shape: a call's first piece has its id, type and name."""
    if piece.id is None:
        return {"index": piece.index, "function": {"arguments": piece.arguments}}
    return {"index": piece.index, "id": piece.id, "type": "function",
            "function": {"name": piece.name, "arguments": piece.arguments}}


def whole_tool_calls(pieces: tuple[ToolCallDelta, ...]) -> list[dict]:
    """A reply's streamed pieces joined into OpenAI's `message.tool_calls`."""
    calls: dict[int, dict] = {}
    for piece in pieces:
        call = calls.setdefault(piece.index, {"id": None, "type": "function",
                                              "function": {"name": None, "arguments": ""}})
        call["id"] = piece.id or call["id"]
        call["function"]["name"] = piece.name or call["function"]["name"]
        call["function"]["arguments"] += piece.arguments
    return [calls[index] for index in sorted(calls)]


def logprobs_object(entries: list[dict] | None) -> dict | None:
    return None if entries is None else {"content": entries, "refusal": None}


def completion(job_id: str, model: str, text: str, finish_reason: str | None,
               usage_payload: dict, logprobs: list[dict] | None = None,
               tool_calls: tuple[ToolCallDelta, ...] = (), reasoning: str = "") -> dict:
    message = {"role": "assistant", "content": text}
    if tool_calls:  # OpenAI: content null when the reply only calls
        message = {"role": "assistant", "content": text if text.strip() else None,
                   "tool_calls": whole_tool_calls(tool_calls)}
    if reasoning:  # a harmony target's analysis channel, named as vLLM and DeepSeek name it
        message["reasoning_content"] = reasoning
    return {"id": job_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message,
                         "logprobs": logprobs_object(logprobs), "finish_reason": finish_reason}],
            "usage": usage_payload}
