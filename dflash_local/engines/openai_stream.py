"""A streamed chat completion from an OpenAI-compatible server, turned into StepEvents and one
request's speculative totals.

Statistics, best first: our service's `dflash` chunk objects (exact, per round); vLLM's per-chunk
`token_ids` (one chunk = one engine step, so accepted = len - 1) checked against its Prometheus
counters read before and after the request; SGLang's `sglext.spec_tokens_details` (>= 0.5.19) or
its counters. Counter deltas belong to this request only while nobody else uses the server.

Boundary: the request body, the SSE lines of a response the engine opened, and the chunks; the
engine opens the stream and reads the counters around it (openai_endpoint.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx

from dflash_local.engines.openai_endpoint import Endpoint, error_from, reads_speculation
from dflash_local.engines.server_flags import counter_delta
from dflash_local.engines.table import SGLANG, VLLM
from dflash_local.errors import EngineUnavailableError
from dflash_local.events import GenerationParams, OutputConstraint, StepEvent, decode_rate


@dataclass
class RemoteStats:
    """One request's speculative totals as the server reported them. τ counts the bonus token."""

    source: str  # "dflash" | "vllm-metrics" | "sglang-details" | "sglang-metrics" | "none"
    rounds: int = 0  # verify passes after the first token
    drafted: int = 0
    accepted: int = 0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, those the server's prefix cache gave
    accepted_per_position: list[int] = field(default_factory=list)  # vLLM: rounds accepting pos k
    per_round_exact: bool = False  # the events' per-round counts agree with these totals
    ttft_s: float = 0.0  # client-observed: request sent -> first token
    decode_s: float = 0.0  # first token -> last token

    @property
    def tau(self) -> float:
        return 1.0 + self.accepted / self.rounds if self.rounds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return decode_rate(self.completion_tokens, self.decode_s)


def request_body(endpoint: Endpoint, messages: list[dict], params: GenerationParams,
                 thinking: bool | None, speculative: bool) -> dict:
    body = {"model": endpoint.model, "messages": messages, "stream": True,
            "max_tokens": params.max_tokens, "temperature": params.temperature,
            "top_p": params.top_p, "stream_options": {"include_usage": True}}
    if params.seed is not None:
        body["seed"] = params.seed
    if thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": thinking}
    if params.constraint is not None:
        body.update(constraint_fields(endpoint.kind, params.constraint))
    if endpoint.kind == "dflash-local":
        body["speculative"] = speculative
        if params.block_size.request_value is not None:
            body["block_size"] = params.block_size.request_value
    elif reads_speculation(endpoint):
        body["stream_options"]["continuous_usage_stats"] = True
        if params.top_k:
            body["top_k"] = params.top_k
        if params.stop_token_ids:
            body["stop_token_ids"] = list(params.stop_token_ids)
        details = "return_token_ids" if endpoint.kind == VLLM.name else "return_spec_tokens_details"
        body[details] = True
    return body


def constraint_fields(server_kind: str, constraint: OutputConstraint) -> dict:
    """A constraint as the server's own request fields: a schema as OpenAI's `response_format`
    everywhere; a regex or a Lark grammar as vLLM's (and our) `structured_outputs`, a regex as
    SGLang's `regex`. What a server cannot take was refused before (table.constraint_kinds)."""
    if constraint.kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if constraint.kind == "json_schema":
        return {"response_format": {"type": "json_schema", "json_schema": {
            "name": "output", "schema": json.loads(constraint.source), "strict": True}}}
    if server_kind == SGLANG.name:
        return {"regex": constraint.source}
    field = "regex" if constraint.kind == "regex" else "grammar"
    return {"structured_outputs": {field: constraint.source}}


def sse_chunks(response: httpx.Response, where: str) -> Iterator[dict]:
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, comments, `event:` names
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            raise EngineUnavailableError(
                f"{where} sent a malformed chunk: {data[:200]!r}") from None
        if "error" in chunk:
            raise error_from(None, chunk, where)
        yield chunk


def cached_tokens(usage: dict) -> int:
    """OpenAI's usage.prompt_tokens_details.cached_tokens: our service always reports it, vLLM
    and SGLang with the flag their launcher passes (server_flags.py); absent or null: 0."""
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


class EventBuilder:
    """Chunks -> StepEvents, plus the request's totals once the stream is over."""

    def __init__(self, endpoint: Endpoint, speculative: bool, started: float):
        self.endpoint, self.speculative, self.started = endpoint, speculative, started
        self.width = endpoint.block_size if speculative else 1  # a server round's, without counts
        self.first_at: float | None = None
        self.last_at = started
        self.rounds = self.accepted = self.drafted = self.tokens = 0
        self.usage: dict = {}
        self.details: dict | None = None
        self.exact = endpoint.kind == "dflash-local"

    def feed(self, chunk: dict) -> StepEvent | None:
        usage = chunk.get("usage") or {}
        self.usage.update(usage)
        spec = (chunk.get("sglext") or {}).get("spec_tokens_details")
        self.details = spec[0] if isinstance(spec, list) and spec else spec or self.details
        if not chunk.get("choices"):
            return None
        choice = chunk["choices"][0]
        delta = choice.get("delta") or {}
        reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
        text = reasoning + (delta.get("content") or "")
        step = chunk.get("dflash")
        ids = tuple(step["token_ids"] if step else choice.get("token_ids") or ())
        finish = choice.get("finish_reason")
        if not (text or ids or finish):
            return None  # the role-only first chunk
        now = time.monotonic()
        first = self.first_at is None
        if first:
            self.first_at = now
        self.last_at = now
        counted = len(ids) or self._usage_tokens(usage)
        self.tokens += counted
        if step:
            drafted, accepted, round_index = step["drafted"], step["accepted"], step["round"]
        elif first or not counted:  # no count (a generic server): not a round we can measure
            drafted, accepted, round_index = 0, 0, 0 if first else max(self.rounds, 1)
        else:  # one chunk = one engine step: the bonus token is the one not drafted
            drafted = self.width - 1 if self.speculative else 0
            accepted, round_index = counted - 1 if self.speculative else 0, self.rounds + 1
        if round_index > 0 and counted:
            self.rounds = round_index
            self.drafted, self.accepted = self.drafted + drafted, self.accepted + accepted
        return StepEvent(
            token_ids=ids, text=text, drafted=drafted, accepted=accepted, round_index=round_index,
            draft_depth=int((step or {}).get("draft_depth", drafted)),  # no depth: a chain
            elapsed_s=now - self.first_at, prefill_s=self.first_at - self.started,
            prompt_tokens=int(usage.get("prompt_tokens") or (step or {}).get("prompt_tokens") or 0),
            cached_tokens=cached_tokens(usage),
            width=step["block_size"] if step else self.width, finish_reason=finish,
            accepted_chars=int((step or {}).get("accepted_chars") or 0),
            lookup_accepted=int((step or {}).get("copied") or 0),
            lookup_accepted_chars=int((step or {}).get("copied_chars") or 0),
            mode=(step or {}).get("mode") or ("speculative" if self.speculative else "plain"))

    def _usage_tokens(self, usage: dict) -> int:
        total = int(usage.get("completion_tokens") or 0)
        return max(total - self.tokens, 0)

    def finish(self, before: dict | None, after: dict | None) -> RemoteStats:
        usage = self.usage
        stats = RemoteStats("dflash" if self.exact else "none", rounds=self.rounds,
                            drafted=self.drafted, accepted=self.accepted,
                            completion_tokens=int(usage.get("completion_tokens") or self.tokens),
                            prompt_tokens=int(usage.get("prompt_tokens") or 0),
                            cached_tokens=cached_tokens(usage), per_round_exact=self.exact)
        if self.first_at is not None:
            stats.ttft_s = self.first_at - self.started
            stats.decode_s = self.last_at - self.first_at
        if not self.speculative or self.exact:
            return stats
        server = None
        if self.details:
            stats.source = "sglang-details"
            server = tuple(self.details.get(key, 0) for key in (
                "spec_verify_ct", "spec_num_proposed_drafts", "spec_num_correct_drafts"))
        elif before and after:
            delta = counter_delta(before, after)
            if self.endpoint.kind == VLLM.name:
                stats.source = "vllm-metrics"
                stats.accepted_per_position = [int(v) for v in delta["per_pos"]]
                server = (delta["drafts"], delta["draft_tokens"], delta["accepted_tokens"])
            else:
                stats.source = "sglang-metrics"
                # completion = 1 (prefill) + rounds + accepted
                rounds = delta["verify_calls"]
                accepted = max(delta["generation_tokens"] - rounds - 1, 0)
                server = (rounds, rounds * (self.width - 1), accepted)
        if server is not None:
            rounds, drafted, accepted = (int(value) for value in server)
            stats.per_round_exact = (rounds, accepted) == (self.rounds, self.accepted)
            stats.rounds, stats.drafted, stats.accepted = rounds, drafted, accepted
        return stats
