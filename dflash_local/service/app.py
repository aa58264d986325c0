"""The HTTP routes: OpenAI chat and Responses, Anthropic Messages, and DFlash management.
Thin: they parse, delegate, shape.

`create_app(state)` builds the app around a ServiceState, so tests and the CLI start the same
server. With an API key, every route but /health needs it (`Authorization: Bearer <key>` or
`x-api-key: <key>`).
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import asdict

import psutil
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from dflash_local import __version__
from dflash_local.errors import InvalidRequestError
from dflash_local.events import parse_block_size
from dflash_local.pairs.catalog import AVAILABLE, INCOMPLETE, ModelSpec, find_local
from dflash_local.pairs.memory_budget import engine_budgets
from dflash_local.pairs.pair_fit import ModelFiles, loaded_fit, pair_fits
from dflash_local.service import anthropic_messages, chat, jobs, responses, responses_api
from dflash_local.service.anthropic_messages import MESSAGES_PATH, AnthropicErrors
from dflash_local.service.anthropic_schemas import MessagesRequest
from dflash_local.service.api_errors import error_response, install_handlers
from dflash_local.service.downloads import follow, public_snapshot
from dflash_local.service.guards import (
    DEFAULT_MAX_BODY_BYTES,
    LOOPBACK_HOSTS,
    BodyLimit,
    HostAllowList,
)
from dflash_local.service.responses_api_schemas import ResponsesRequest
from dflash_local.service.schemas import ChatCompletionRequest, DownloadRequest, LoadRequest
from dflash_local.service.state import ServiceState

OPEN_PATHS = ("/health",)
DEFAULT_FIT_CONTEXT = 8192  # the context the catalog's fit estimates are worked at, unless asked


class BearerAuth:
    """Pure ASGI (no buffering of streams): checked before the body is even read. The key comes
    as `Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY` (Anthropic's)."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if self.api_key is None or scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if not hmac.compare_digest(presented_key(dict(scope["headers"])), self.api_key):
            response = error_response(
                401, "missing or invalid API key (Authorization: Bearer ..., or x-api-key)",
                "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def presented_key(headers: dict[bytes, bytes]) -> bytes:
    scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
    if scheme.lower() == b"bearer":
        return token.strip()
    return b"" if b"authorization" in headers else headers.get(b"x-api-key", b"").strip()


def create_app(state: ServiceState, allowed_hosts: Iterable[str] = LOOPBACK_HOSTS,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        await asyncio.to_thread(state.shutdown)

    # no docs page, so no schema either: it would only map the API for a stranger
    app = FastAPI(title="dflash-local", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.dflash = state
    install_handlers(app)
    # the last added runs first: Host, then the key, then the body's size
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(BearerAuth, api_key=state.api_key)
    app.add_middleware(HostAllowList, allowed_hosts=allowed_hosts)
    app.add_middleware(AnthropicErrors)  # outermost: it reshapes the guards' errors too

    @app.get("/health")
    async def health() -> dict:
        loaded = state.loaded
        return {"status": "ok", "model": loaded.served_name if loaded else None,
                "loading": state.loading}

    @app.get("/v1/models")
    async def models() -> dict:
        loaded = state.loaded
        data = [] if loaded is None else [{
            "id": loaded.served_name, "object": "model", "created": loaded.loaded_at,
            "owned_by": "dflash-local", "dflash": loaded.describe()}]
        return {"object": "list", "data": data}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        loaded = state.require_model(body.model)
        return await chat.complete(body, loaded, request)

    @app.post(MESSAGES_PATH)
    async def messages(body: MessagesRequest, request: Request):
        loaded = state.require_model(body.model)
        return await anthropic_messages.create(body, loaded, request)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        loaded = state.require_model(body.model)
        return await responses_api.create(body, loaded, request)

    @app.get("/dflash/catalog")
    async def catalog(context_tokens: int = DEFAULT_FIT_CONTEXT) -> dict:
        if not 1 <= context_tokens <= 1 << 22:
            raise InvalidRequestError(f"context_tokens {context_tokens} is not in [1, {1 << 22}]")
        budgets = await asyncio.to_thread(engine_budgets)
        return {"pairs": await asyncio.to_thread(_catalog_listing, state, budgets, context_tokens),
                "engines": {engine: budget.to_json() for engine, budget in budgets.items()},
                "context_tokens": context_tokens}

    @app.post("/dflash/load")
    async def load(body: LoadRequest) -> dict:
        block_size = parse_block_size(body.block_size) if body.block_size is not None else None
        if body.pair is not None:
            await asyncio.to_thread(state.load_pair, body.pair, body.engine, block_size,
                                    body.recalibrate, body.draft_window)
        else:
            await asyncio.to_thread(state.load_repos, body.engine, body.target,
                                    body.drafter, block_size, body.recalibrate, body.draft_window)
        return _status(state)

    @app.get("/dflash/status")
    async def status() -> dict:
        return _status(state)

    @app.post("/dflash/downloads", status_code=202)
    async def start_download(body: DownloadRequest) -> dict:
        download = state.downloads.start(body.pair, body.context_tokens)
        return {**public_snapshot(download), "events": f"/dflash/downloads/{download.id}/events"}

    @app.get("/dflash/downloads")
    async def list_downloads() -> dict:
        return {"downloads": state.downloads.list()}

    @app.get("/dflash/downloads/{download_id}")
    async def get_download(download_id: str) -> dict:
        return public_snapshot(state.downloads.get(download_id))

    @app.get("/dflash/downloads/{download_id}/events")
    async def download_events(download_id: str) -> StreamingResponse:
        download = state.downloads.get(download_id)
        return StreamingResponse(_sse(follow(download)), media_type="text/event-stream",
                                 headers=jobs.SSE_HEADERS)

    @app.delete("/dflash/downloads/{download_id}")
    async def cancel_download(download_id: str) -> dict:
        download = state.downloads.get(download_id)
        return {"id": download.id, "cancel_requested": download.cancel(), **public_snapshot(download)}

    return app


async def _sse(snapshots: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    async for snapshot in snapshots:
        yield responses.sse(snapshot)
    yield responses.sse("[DONE]")


def _catalog_listing(state: ServiceState, budgets: dict, context_tokens: int) -> list[dict]:
    loaded = state.loaded
    found: dict[ModelSpec, tuple[str, ModelFiles]] = {}

    def on_disk(model: ModelSpec) -> tuple[str, ModelFiles]:
        """Located, read and sized once per model per listing (pairs share targets)."""
        if model not in found:
            where, directory = find_local(model, state.hub_cache_dir)
            found[model] = (where, ModelFiles.read(directory))
        return found[model]

    listing = []
    for pair in state.catalog.pairs:
        located = {"target": on_disk(pair.target), "drafter": on_disk(pair.drafter)}
        fits = pair_fits(pair, budgets, context_tokens, located["target"][1], located["drafter"][1])
        is_loaded = loaded is not None and loaded.pair_id == pair.id
        own = _loaded_fit(loaded, budgets, context_tokens) if is_loaded else None
        if own is not None:  # the loaded pair's own figure: its files, in the dtype it runs in
            fits[loaded.engine.pair.engine] = own
        local = {role: where for role, (where, _) in located.items()}
        listing.append({**pair.to_json(), "fit": fits, "loaded": is_loaded,
                        "available": {role: where == AVAILABLE for role, where in local.items()},
                        # a partial download: "incomplete: resume or delete"
                        "incomplete": {role: where for role, where in local.items()
                                       if where == INCOMPLETE}})
    return listing


def _loaded_fit(loaded, budgets: dict, context_tokens: int) -> dict | None:
    info = loaded.engine.pair
    if info.engine not in budgets or info.target_path is None:  # a server holds the weights
        return None
    return loaded_fit(info.target_path, info.drafter_path, info.dtype, budgets[info.engine],
                      context_tokens)


def _status_fit(loaded) -> dict | None:
    """Worked out once per loaded pair: a status poll would read its files every time."""
    if loaded.status_fit is None:
        loaded.status_fit = _loaded_fit(loaded, engine_budgets(), DEFAULT_FIT_CONTEXT) or {}
    return loaded.status_fit or None


def _status(state: ServiceState) -> dict:
    loaded = state.loaded
    memory = psutil.virtual_memory()
    return {
        "loaded": loaded.describe() if loaded else None,
        "loading": state.loading,
        "loading_phase": state.loading_phase,
        "load_error": state.load_error,  # paths redacted when it was recorded
        "load_warning": state.load_warning,
        "capabilities": asdict(loaded.engine.capabilities) if loaded else None,
        "loaded_fit": _status_fit(loaded) if loaded else None,
        "worker": loaded.worker.status() if loaded else None,
        "memory": {"rss_bytes": psutil.Process().memory_info().rss,
                   "available_bytes": memory.available, "total_bytes": memory.total},
        "downloads_active": sum(1 for d in state.downloads.list() if d["status"] not in
                                ("done", "failed", "cancelled")),
    }
