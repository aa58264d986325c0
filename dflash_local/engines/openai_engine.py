"""An engine over any OpenAI-compatible server: our own service, vLLM, SGLang, or another.

Boundary: HTTP only. Stream a chat completion (httpx), map the server's errors onto ours, and read
the speculative statistics each server exposes. A remote engine cannot tokenize, so its entry point
is `stream_chat(messages, params, thinking)`; closing that iterator closes the HTTP stream, which
is how the server learns that the client left.

Statistics, best first: our service's `dflash` chunk objects (exact, per round); vLLM's per-chunk
`token_ids` (one chunk = one engine step, so accepted = len - 1) checked against its Prometheus
counters read before and after the request; SGLang's `sglext.spec_tokens_details` (>= 0.5.19) or
its counters. Counter deltas belong to this request only while nobody else uses the server.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import httpx

from dflash_local.engines.base import Engine, PairInfo
from dflash_local.engines.server_flags import (
    counter_delta,
    parse_prometheus,
    sglang_counters,
    vllm_counters,
)
from dflash_local.errors import (
    DFlashError,
    EngineUnavailableError,
    GenerationCancelled,
    InvalidRequestError,
    ModelNotFoundError,
    PromptTooLongError,
)
from dflash_local.events import EngineCapabilities, GenerationParams, StepEvent, decode_rate

SERVER_SIDE_DRAFTER = "(server-side DFlash)"  # pair.drafter when the server speculates unnamed
OWNERS = {"dflash-local": "dflash-local", "vllm": "vllm", "sglang": "sglang"}  # /v1/models owned_by
ERRORS_BY_CODE = {cls.code: cls for cls in (PromptTooLongError, InvalidRequestError,
                                            ModelNotFoundError, EngineUnavailableError,
                                            GenerationCancelled)}
SETTLE_S, SETTLE_TIMEOUT_S = 0.05, 2.0  # polling the counters after a request


@dataclass
class RemoteStats:
    """One request's speculative totals as the server reported them. τ counts the bonus token."""

    source: str  # "dflash" | "vllm-metrics" | "sglang-details" | "sglang-metrics" | "none"
    rounds: int = 0  # verify passes after the first token
    drafted: int = 0
    accepted: int = 0
    completion_tokens: int = 0
    prompt_tokens: int = 0
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


# --- errors ---

def error_from(status: int | None, payload: object, where: str) -> DFlashError:
    """Our error for a server's error body (OpenAI shape, FastAPI's `detail`, or plain text)."""
    error = payload.get("error", payload) if isinstance(payload, dict) else {"message": payload}
    if not isinstance(error, dict):
        error = {"message": error}
    message = str(error.get("message") or error.get("detail") or payload)[:2000]
    code = error.get("code")
    if status is None and isinstance(code, int):
        status = code
    if isinstance(code, str) and code in ERRORS_BY_CODE:
        cls = ERRORS_BY_CODE[code]
    elif re.search(r"context length|maximum context|too long", message, re.IGNORECASE):
        cls = PromptTooLongError
    elif status in (400, 422):
        cls = InvalidRequestError
    elif status == 404:
        cls = ModelNotFoundError
    else:
        cls = EngineUnavailableError
    return cls(f"{where} answered {status or 'an error'}: {message}")


@dataclass
class Endpoint:
    """One server: its base URL, a client, the model it serves and what kind of server it is."""

    url: str
    client: httpx.Client
    model: str = ""
    kind: str = "openai"
    max_context: int = 0  # 0 = not reported (the server checks the context itself)
    drafter: str | None = None  # what the server speculates with; None = plain
    block_size: int = 1  # the server's B (1 = plain)

    def get(self, path: str) -> httpx.Response:
        try:
            response = self.client.get(self.url + path)
        except httpx.HTTPError as exc:
            raise EngineUnavailableError(f"cannot reach {self.url}: {exc}") from None
        if response.status_code >= 400:
            raise error_from(response.status_code, _json_or_text(response), self.url + path)
        return response


def connect(url: str, api_key: str | None, model: str | None, read_timeout_s: float) -> Endpoint:
    """GET /v1/models: proves the URL and key work and names the model and the server kind."""
    url = url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = httpx.Timeout(connect=5.0, read=read_timeout_s, write=30.0, pool=5.0)
    endpoint = Endpoint(url, httpx.Client(headers=headers, timeout=timeout))
    try:
        listing = endpoint.get("/v1/models").json()
        models = listing.get("data") or [] if isinstance(listing, dict) else None
    except BaseException as exc:
        endpoint.client.close()
        if isinstance(exc, ValueError):
            raise EngineUnavailableError(f"{url}/v1/models answered something not JSON") from None
        raise
    if models is None:
        endpoint.client.close()
        raise EngineUnavailableError(
            f"{url}/v1/models is not an OpenAI model list: {listing!r:.200}")
    entry = next((m for m in models if model in (None, m.get("id"))), None)
    if entry is None:
        endpoint.client.close()
        names = ", ".join(str(m.get("id")) for m in models) or "none"
        raise ModelNotFoundError(f"{url} does not serve model {model!r} (it serves: {names})")
    endpoint.model = entry["id"]
    endpoint.kind = OWNERS.get(entry.get("owned_by"), "openai")
    endpoint.max_context = int(entry.get("max_model_len") or 0)
    if endpoint.kind == "dflash-local":
        described = entry.get("dflash") or {}
        endpoint.drafter = described.get("drafter")
        endpoint.block_size = int(described.get("drafter_block_size") or 1)
    return endpoint


def probe_speculation(endpoint: Endpoint) -> None:
    """Whether a vLLM/SGLang server speculates, and its B, from what it exposes."""
    if endpoint.kind == "vllm":
        per_pos = vllm_counters(parse_prometheus(endpoint.get("/metrics").text))["per_pos"]
        if per_pos:  # vLLM registers these counters only with a speculative config
            endpoint.drafter, endpoint.block_size = SERVER_SIDE_DRAFTER, len(per_pos) + 1
    elif endpoint.kind == "sglang":
        info = endpoint.get("/get_server_info").json()
        if info.get("speculative_algorithm"):
            endpoint.drafter = info.get("speculative_draft_model_path") or SERVER_SIDE_DRAFTER
            endpoint.block_size = int(info.get("speculative_num_draft_tokens") or 1)


class RemoteEngine(Engine):
    """Streams from a server; `plain` (optional) is a second server of the same target without
    speculation, used when a request asks for speculation off and the main server cannot."""

    name = "openai"

    def __init__(self, base_url: str, *, api_key: str | None = None, model: str | None = None,
                 plain_base_url: str | None = None, drafter: str | None = None,
                 block_size: int | None = None, read_timeout_s: float = 600.0,
                 engine_name: str = "openai", counters: bool = True):
        self.main = connect(base_url, api_key, model, read_timeout_s)
        self.plain: Endpoint | None = None
        try:
            if drafter is not None:  # the launcher knows what it started
                self.main.drafter = drafter
                self.main.block_size = block_size or self.main.block_size
            elif self.main.kind in ("vllm", "sglang"):
                probe_speculation(self.main)
            if plain_base_url:
                self.plain = connect(plain_base_url, api_key, None, read_timeout_s)
        except BaseException:
            self.close()
            raise
        self.name = engine_name
        self.counters = counters  # False: the server's version reports acceptance otherwise
        self.last_stats: RemoteStats | None = None
        own = self.main.kind == "dflash-local"
        self.pair = PairInfo(engine=engine_name, target=self.main.model, drafter=self.main.drafter,
                             dtype="server", block_size=self.main.block_size)
        self.capabilities = EngineCapabilities(
            speculative_toggle=own or (self.plain is not None and self.main.drafter is not None),
            sampling=True, max_context=self.main.max_context, block_size_per_request=own,
            tokenizes=False)

    def encode_chat(self, messages: list[dict], thinking: bool | None = None) -> list[int]:
        raise EngineUnavailableError(f"{self.main.url} tokenizes on the server: use stream_chat")

    def encode_raw(self, text: str) -> list[int]:
        raise EngineUnavailableError(f"{self.main.url} tokenizes on the server: use stream_chat")

    def stream(self, prompt_ids: list[int], params: GenerationParams) -> Iterator[StepEvent]:
        raise EngineUnavailableError(
            f"{self.main.url} takes messages, not token ids: use stream_chat")

    def close(self) -> None:
        for endpoint in (getattr(self, "main", None), getattr(self, "plain", None)):
            if endpoint is not None:
                endpoint.client.close()

    def stream_chat(self, messages: list[dict], params: GenerationParams,
                    thinking: bool | None = None) -> Iterator[StepEvent]:
        """Generate from chat messages. A request the server cannot honour (speculation off on
        a server that always speculates) raises here; the server's own errors on first `next`."""
        endpoint = self._route(params)
        speculative = params.speculative and endpoint.drafter is not None
        body = request_body(endpoint, messages, params, thinking, speculative)
        return self._stream(endpoint, body, speculative)

    def _route(self, params: GenerationParams) -> Endpoint:
        main = self.main
        if main.kind == "dflash-local" or params.speculative == (main.drafter is not None):
            return main
        if not params.speculative and self.plain is not None:
            return self.plain
        if params.speculative:
            raise InvalidRequestError(f"{main.url} serves {main.model} without speculation")
        raise InvalidRequestError(
            f"the {main.kind} server at {main.url} speculates on every request and cannot turn "
            f"it off per request: give a plain server of the same target (--plain-base-url) to "
            f"compare")

    def _stream(self, endpoint: Endpoint, body: dict, speculative: bool) -> Iterator[StepEvent]:
        self.last_stats = None
        before = read_counters(endpoint) if speculative and self.counters else None
        events = EventBuilder(endpoint, speculative, time.monotonic())
        held: StepEvent | None = None
        try:
            with endpoint.client.stream("POST", endpoint.url + "/v1/chat/completions",
                                        json=body) as response:
                if response.status_code >= 400:
                    response.read()
                    raise error_from(response.status_code, _json_or_text(response), endpoint.url)
                for chunk in sse_chunks(response, endpoint.url):
                    event = events.feed(chunk)
                    if event is None:
                        continue
                    if event.token_ids or event.text or held is None:
                        if held is not None:
                            yield held
                        held = event
                    else:  # a finish-only chunk: it ends the round already held
                        held = replace(held, finish_reason=event.finish_reason)
        except httpx.HTTPError as exc:
            raise EngineUnavailableError(f"{endpoint.url} broke off the stream: {exc}") from None
        after = settled_counters(endpoint, before, events.rounds) if before else None
        self.last_stats = events.finish(before, after)
        if held is not None:
            yield held


def request_body(endpoint: Endpoint, messages: list[dict], params: GenerationParams,
                 thinking: bool | None, speculative: bool) -> dict:
    body = {"model": endpoint.model, "messages": messages, "stream": True,
            "max_tokens": params.max_tokens, "temperature": params.temperature,
            "top_p": params.top_p, "stream_options": {"include_usage": True}}
    if params.seed is not None:
        body["seed"] = params.seed
    if thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": thinking}
    if endpoint.kind == "dflash-local":
        body["speculative"] = speculative
        if params.block_size.request_value is not None:
            body["block_size"] = params.block_size.request_value
    elif endpoint.kind in ("vllm", "sglang"):
        body["stream_options"]["continuous_usage_stats"] = True
        if params.top_k:
            body["top_k"] = params.top_k
        if params.stop_token_ids:
            body["stop_token_ids"] = list(params.stop_token_ids)
        body["return_token_ids" if endpoint.kind == "vllm" else "return_spec_tokens_details"] = True
    return body


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


def read_counters(endpoint: Endpoint) -> dict | None:
    """vLLM/SGLang speculative counters now (None: not that kind of server, or no /metrics)."""
    if endpoint.kind not in ("vllm", "sglang"):
        return None
    return _counters_once(endpoint)


def settled_counters(endpoint: Endpoint, before: dict, min_rounds: int) -> dict | None:
    """Counters once they cover the rounds the client saw and two reads agree. A server counts a
    step just after streaming it, so the first read after [DONE] can still be short."""
    reading, deadline = _counters_once(endpoint), time.monotonic() + SETTLE_TIMEOUT_S
    rounds_key = "drafts" if endpoint.kind == "vllm" else "verify_calls"
    while reading is not None and time.monotonic() < deadline:
        time.sleep(SETTLE_S)
        again = _counters_once(endpoint)
        if again == reading and again[rounds_key] - before.get(rounds_key, 0.0) >= min_rounds:
            break
        reading = again
    return reading


def _counters_once(endpoint: Endpoint) -> dict | None:
    try:
        samples = parse_prometheus(endpoint.get("/metrics").text)
    except DFlashError:
        return None  # no /metrics (SGLang without --enable-metrics): no totals, not an error
    return vllm_counters(samples) if endpoint.kind == "vllm" else sglang_counters(samples)


class EventBuilder:
    """Chunks -> StepEvents, plus the request's totals once the stream is over."""

    def __init__(self, endpoint: Endpoint, speculative: bool, started: float):
        self.endpoint, self.speculative, self.started = endpoint, speculative, started
        self.block_size = endpoint.block_size if speculative else 1
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
            drafted = self.block_size - 1 if self.speculative else 0
            accepted, round_index = counted - 1 if self.speculative else 0, self.rounds + 1
        if round_index > 0 and counted:
            self.rounds = round_index
            self.drafted, self.accepted = self.drafted + drafted, self.accepted + accepted
        return StepEvent(
            token_ids=ids, text=text, drafted=drafted, accepted=accepted, round_index=round_index,
            draft_depth=int((step or {}).get("draft_depth", drafted)),  # no depth: a chain
            elapsed_s=now - self.first_at, prefill_s=self.first_at - self.started,
            prompt_tokens=int(usage.get("prompt_tokens") or (step or {}).get("prompt_tokens") or 0),
            block_size=step["block_size"] if step else self.block_size, finish_reason=finish,
            accepted_chars=int((step or {}).get("accepted_chars") or 0),
            copied=int((step or {}).get("copied") or 0), copied_chars=int((step or {}).get("copied_chars") or 0),
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
                            per_round_exact=self.exact)
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
            if self.endpoint.kind == "vllm":
                stats.source = "vllm-metrics"
                stats.accepted_per_position = [int(v) for v in delta["per_pos"]]
                server = (delta["drafts"], delta["draft_tokens"], delta["accepted_tokens"])
            else:
                stats.source = "sglang-metrics"
                # completion = 1 (prefill) + rounds + accepted
                rounds = delta["verify_calls"]
                accepted = max(delta["generation_tokens"] - rounds - 1, 0)
                server = (rounds, rounds * (self.block_size - 1), accepted)
        if server is not None:
            rounds, drafted, accepted = (int(value) for value in server)
            stats.per_round_exact = (rounds, accepted) == (self.rounds, self.accepted)
            stats.rounds, stats.drafted, stats.accepted = rounds, drafted, accepted
        return stats


def _json_or_text(response: httpx.Response) -> object:
    try:
        return response.json()
    except ValueError:
        return response.text
