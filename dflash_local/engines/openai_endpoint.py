"""One OpenAI-compatible server as the remote engine sees it: connect, name its kind, probe its
speculation, read its counters, and map its errors onto ours.

Boundary: the requests around a chat completion (GET /v1/models, /metrics, /get_server_info);
streaming the completion is openai_stream.py's, choosing a server per request openai_engine.py's.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import httpx

from dflash_local.engines.server_flags import parse_prometheus, sglang_counters, vllm_counters
from dflash_local.engines.table import OPENAI, SGLANG, VLLM
from dflash_local.errors import (
    DFlashError,
    EngineUnavailableError,
    GenerationCancelled,
    InvalidRequestError,
    ModelNotFoundError,
    PromptTooLongError,
)

SERVER_SIDE_DRAFTER = "(server-side DFlash)"  # pair.drafter when the server speculates unnamed
# the servers whose speculation this module reads (each its own counters and server info)
SPECULATING_SERVERS = (VLLM, SGLANG)
# /v1/models owned_by -> the endpoint's kind: our own service, or a speculating server's engine
OWNERS = {"dflash-local": "dflash-local",
          **{spec.owned_by: spec.name for spec in SPECULATING_SERVERS}}
ERRORS_BY_CODE = {cls.code: cls for cls in (PromptTooLongError, InvalidRequestError,
                                            ModelNotFoundError, EngineUnavailableError,
                                            GenerationCancelled)}
SETTLE_S, SETTLE_TIMEOUT_S = 0.05, 2.0  # polling the counters after a request


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
    kind: str = OPENAI.name  # else a value of OWNERS
    max_context: int = 0  # 0 = not reported (the server checks the context itself)
    drafter: str | None = None  # what the server speculates with; None = plain
    block_size: int = 1  # the server's B (1 = plain)

    def get(self, path: str) -> httpx.Response:
        try:
            response = self.client.get(self.url + path)
        except httpx.HTTPError as exc:
            raise EngineUnavailableError(f"cannot reach {self.url}: {exc}") from None
        if response.status_code >= 400:
            raise error_from(response.status_code, json_or_text(response), self.url + path)
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
    endpoint.kind = OWNERS.get(entry.get("owned_by"), OPENAI.name)
    endpoint.max_context = int(entry.get("max_model_len") or 0)
    if endpoint.kind == "dflash-local":
        described = entry.get("dflash") or {}
        endpoint.drafter = described.get("drafter")
        endpoint.block_size = int(described.get("drafter_block_size") or 1)
    return endpoint


def reads_speculation(endpoint: Endpoint) -> bool:
    """A vLLM or SGLang server: its speculation is probed and its counters read."""
    return endpoint.kind in (spec.name for spec in SPECULATING_SERVERS)


def probe_speculation(endpoint: Endpoint) -> None:
    """Whether a vLLM/SGLang server speculates, and its B, from what it exposes."""
    if endpoint.kind == VLLM.name:
        per_pos = vllm_counters(parse_prometheus(endpoint.get("/metrics").text))["per_pos"]
        if per_pos:  # vLLM registers these counters only with a speculative config
            endpoint.drafter, endpoint.block_size = SERVER_SIDE_DRAFTER, len(per_pos) + 1
    elif endpoint.kind == SGLANG.name:
        info = endpoint.get("/get_server_info").json()
        if info.get("speculative_algorithm"):
            endpoint.drafter = info.get("speculative_draft_model_path") or SERVER_SIDE_DRAFTER
            endpoint.block_size = int(info.get("speculative_num_draft_tokens") or 1)


def read_counters(endpoint: Endpoint) -> dict | None:
    """vLLM/SGLang speculative counters now (None: not that kind of server, or no /metrics)."""
    if not reads_speculation(endpoint):
        return None
    return _counters_once(endpoint)


def settled_counters(endpoint: Endpoint, before: dict, min_rounds: int) -> dict | None:
    """Counters once they cover the rounds the client saw and two reads agree. A server counts a
    step just after streaming it, so the first read after [DONE] can still be short."""
    reading, deadline = _counters_once(endpoint), time.monotonic() + SETTLE_TIMEOUT_S
    rounds_key = "drafts" if endpoint.kind == VLLM.name else "verify_calls"
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
    return vllm_counters(samples) if endpoint.kind == VLLM.name else sglang_counters(samples)


def json_or_text(response: httpx.Response) -> object:
    """A response's body for error_from: its JSON when it parses, else its text."""
    try:
        return response.json()
    except ValueError:
        return response.text
