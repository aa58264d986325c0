"""An engine over any OpenAI-compatible server: our own service, vLLM, SGLang, or another.

Boundary: HTTP only. Stream a chat completion (httpx), map the server's errors onto ours, and read
the speculative statistics each server exposes. A remote engine cannot tokenize, so its entry point
is `stream_chat(messages, params, thinking)`; closing that iterator closes the HTTP stream, which
is how the server learns that the client left. Talking to one server is openai_endpoint.py's job,
parsing its stream and totalling the statistics openai_stream.py's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace

import httpx

from dflash_local.engines.interface import Engine, PairInfo
from dflash_local.engines.openai_endpoint import (
    Endpoint,
    connect,
    error_from,
    json_or_text,
    probe_speculation,
    read_counters,
    reads_speculation,
    settled_counters,
)
from dflash_local.engines.openai_stream import EventBuilder, RemoteStats, request_body, sse_chunks
from dflash_local.engines.table import OPENAI
from dflash_local.errors import EngineUnavailableError, InvalidRequestError
from dflash_local.events import EngineCapabilities, GenerationParams, StepEvent


class RemoteEngine(Engine):
    """Streams from a server; `plain` (optional) is a second server of the same target without
    speculation, used when a request asks for speculation off and the main server cannot."""

    name = OPENAI.name

    def __init__(self, base_url: str, *, api_key: str | None = None, model: str | None = None,
                 plain_base_url: str | None = None, drafter: str | None = None,
                 block_size: int | None = None, read_timeout_s: float = 600.0,
                 engine_name: str = OPENAI.name, counters: bool = True):
        self.main = connect(base_url, api_key, model, read_timeout_s)
        self.plain: Endpoint | None = None
        try:
            if drafter is not None:  # the launcher knows what it started
                self.main.drafter = drafter
                self.main.block_size = block_size or self.main.block_size
            elif reads_speculation(self.main):
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
                             dtype="server", drafter_block=self.main.block_size)
        self.capabilities = EngineCapabilities(
            speculative_toggle=own or (self.plain is not None and self.main.drafter is not None),
            sampling=True, max_context=self.main.max_context, block_size_per_request=own,
            tokenizes=False)

    def encode_chat(self, messages: list[dict], thinking: bool | None = None,
                    tools: list[dict] | None = None, assistant_prefix: str | tuple[str, ...] = "") -> list[int]:
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
                    raise error_from(response.status_code, json_or_text(response), endpoint.url)
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
