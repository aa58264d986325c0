"""All the app's HTTP: an async client of the dflash-local service (httpx).

Boundary: no Textual. Streams are async iterators; leaving one early (Esc, a cancelled worker)
closes the HTTP response, and the service stops the generation when its client goes away.
Every failure surfaces as `ServiceError` with the service's own message.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx

from dflash_chat.protocol import MODE_SPECULATIVE, ServiceError, StreamChunk, StreamUsage

CONNECT_TIMEOUT_S = 5.0
REQUEST_TIMEOUT_S = 30.0


class DFlashClient:
    def __init__(self, base_url: str, api_key: str | None = None):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=timeout)

    async def aclose(self) -> None:
        await self._http.aclose()

    # --- plain requests ---

    async def health(self) -> dict:
        return await self._request("GET", "/health")

    async def status(self) -> dict:
        return await self._request("GET", "/dflash/status")

    async def catalog(self) -> list[dict]:
        return (await self._request("GET", "/dflash/catalog"))["pairs"]

    async def load_pair(self, pair_id: str) -> dict:
        """Load a catalog pair; returns the new status. Loading can take minutes."""
        return await self._request("POST", "/dflash/load", json={"pair": pair_id}, timeout=None)

    async def start_download(self, pair_id: str) -> dict:
        return await self._request("POST", "/dflash/downloads", json={"pair": pair_id})

    async def cancel_download(self, download_id: str) -> dict:
        return await self._request("DELETE", f"/dflash/downloads/{download_id}")

    async def count_tokens(self, model: str, messages: list[dict],
                           thinking: bool | None = None) -> int:
        """The tokens of the prompt these chat messages make: the service's own count
        (/v1/messages/count_tokens templates them as a generation would)."""
        system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
        body: dict = {"model": model, "messages": [m for m in messages if m["role"] != "system"]}
        if system:
            body["system"] = system
        if thinking is not None:
            body["thinking"] = {"type": "enabled" if thinking else "disabled"}
        return (await self._request("POST", "/v1/messages/count_tokens", json=body))["input_tokens"]

    async def _request(self, method: str, path: str, timeout=httpx.USE_CLIENT_DEFAULT,
                       **kwargs) -> dict:
        try:
            response = await self._http.request(method, path, timeout=timeout, **kwargs)
        except httpx.HTTPError as exc:
            raise _transport_error(self.base_url, exc) from None
        if response.status_code >= 400:
            raise _http_error(response.status_code, response.text)
        return _json_object(response.text)

    # --- streams ---

    async def stream_chat(self, messages: list[dict], **options) -> AsyncIterator[
            StreamChunk | StreamUsage]:
        """Stream a chat completion: StreamChunks, then one StreamUsage (usage is requested)."""
        body = {"messages": messages, "stream": True, "stream_options": {"include_usage": True},
                **options}
        async for payload in self._sse("POST", "/v1/chat/completions", json=body):
            if payload.get("usage"):
                usage = payload["usage"]
                details = usage.get("prompt_tokens_details") or {}  # a prefix cache's share
                yield StreamUsage(usage["prompt_tokens"], usage["completion_tokens"],
                                  usage.get("dflash") or {}, details.get("cached_tokens"))
            for choice in payload.get("choices", ()):
                yield _chunk(choice, payload.get("dflash") or {})

    async def download_events(self, download_id: str) -> AsyncIterator[dict]:
        """A download's progress snapshots, ending with its terminal one."""
        async for payload in self._sse("GET", f"/dflash/downloads/{download_id}/events"):
            yield payload

    async def _sse(self, method: str, path: str, **kwargs) -> AsyncIterator[dict]:
        timeout = httpx.Timeout(None, connect=CONNECT_TIMEOUT_S)  # a long pause is not an error
        try:
            async with self._http.stream(method, path, timeout=timeout, **kwargs) as response:
                if response.status_code >= 400:
                    raise _http_error(response.status_code, (await response.aread()).decode())
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    payload = _json_object(data)
                    error = payload.get("error")
                    if isinstance(error, dict):  # OpenAI's error event, after the stream began
                        raise ServiceError(error.get("message", "error"), 500, error.get("code"))
                    yield payload
        except httpx.HTTPError as exc:
            raise _transport_error(self.base_url, exc) from None


def _json_object(data: str) -> dict:
    try:
        payload = json.loads(data)
    except ValueError:
        payload = None
    if not isinstance(payload, dict):
        raise ServiceError(f"the service sent an event that is not a JSON object: {data[:120]!r}")
    return payload


def _chunk(choice: dict, dflash: dict) -> StreamChunk:
    delta = choice.get("delta") or {}
    return StreamChunk(
        text=delta.get("content") or "", reasoning=delta.get("reasoning_content") or "",
        token_ids=tuple(dflash.get("token_ids", ())), drafted=dflash.get("drafted", 0),
        draft_depth=dflash.get("draft_depth", 0),
        accepted=dflash.get("accepted", 0), round=dflash.get("round", 0),
        block_size=dflash.get("block_size", 1), finish_reason=choice.get("finish_reason"),
        accepted_chars=dflash.get("accepted_chars"), copied_chars=dflash.get("copied_chars"),
        mode=dflash.get("mode", MODE_SPECULATIVE))


def _http_error(status: int, body: str) -> ServiceError:
    try:
        error = json.loads(body)["error"]
        return ServiceError(error["message"], status, error.get("code"))
    except (ValueError, KeyError, TypeError):
        return ServiceError(f"HTTP {status}: {body[:200]}", status)


def _transport_error(base_url: str, exc: httpx.HTTPError) -> ServiceError:
    return ServiceError(f"the service at {base_url} cannot be reached ({type(exc).__name__}: "
                        f"{exc or 'no detail'})")
