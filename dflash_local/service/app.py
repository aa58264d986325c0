"""The HTTP routes: OpenAI-compatible chat plus DFlash management. Thin: they parse, delegate, shape.

`create_app(state)` builds the app around a ServiceState, so tests and the CLI start the same
server. With an API key, every route but /health needs `Authorization: Bearer <key>`.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict

import psutil
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from dflash_local import __version__
from dflash_local.catalog import is_available
from dflash_local.events import parse_block_size
from dflash_local.service import chat, responses
from dflash_local.service.downloads import follow
from dflash_local.service.errors import error_response, install_handlers
from dflash_local.service.schemas import ChatCompletionRequest, DownloadRequest, LoadRequest
from dflash_local.service.state import ServiceState

OPEN_PATHS = ("/health",)


class BearerAuth:
    """Pure ASGI (no buffering of streams): checked before the body is even read."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if self.api_key is None or scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
            response = error_response(401, "missing or invalid API key (Authorization: Bearer ...)",
                                      "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def create_app(state: ServiceState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        await asyncio.to_thread(state.shutdown)

    app = FastAPI(title="dflash-local", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    app.state.dflash = state
    install_handlers(app)
    app.add_middleware(BearerAuth, api_key=state.api_key)

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

    @app.get("/dflash/catalog")
    async def catalog() -> dict:
        return {"pairs": await asyncio.to_thread(_catalog_listing, state)}

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
        return {**download.snapshot(), "events": f"/dflash/downloads/{download.id}/events"}

    @app.get("/dflash/downloads")
    async def list_downloads() -> dict:
        return {"downloads": state.downloads.list()}

    @app.get("/dflash/downloads/{download_id}")
    async def get_download(download_id: str) -> dict:
        return state.downloads.get(download_id).snapshot()

    @app.get("/dflash/downloads/{download_id}/events")
    async def download_events(download_id: str) -> StreamingResponse:
        download = state.downloads.get(download_id)
        return StreamingResponse(_sse(follow(download)), media_type="text/event-stream",
                                 headers=chat.SSE_HEADERS)

    @app.delete("/dflash/downloads/{download_id}")
    async def cancel_download(download_id: str) -> dict:
        download = state.downloads.get(download_id)
        return {"id": download.id, "cancel_requested": download.cancel(), **download.snapshot()}

    return app


async def _sse(snapshots: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    async for snapshot in snapshots:
        yield responses.sse(snapshot)
    yield responses.sse("[DONE]")


def _catalog_listing(state: ServiceState) -> list[dict]:
    loaded = state.loaded
    return [{**pair.to_json(),
             "available": {role: is_available(model, state.hub_cache_dir)
                           for role, model in (("target", pair.target), ("drafter", pair.drafter))},
             "loaded": loaded is not None and loaded.pair_id == pair.id}
            for pair in state.catalog.pairs]


def _status(state: ServiceState) -> dict:
    loaded = state.loaded
    memory = psutil.virtual_memory()
    return {
        "loaded": loaded.describe() if loaded else None,
        "loading": state.loading,
        "loading_phase": state.loading_phase,
        "load_error": state.load_error,
        "load_warning": state.load_warning,
        "capabilities": asdict(loaded.engine.capabilities) if loaded else None,
        "worker": loaded.worker.status() if loaded else None,
        "memory": {"rss_bytes": psutil.Process().memory_info().rss,
                   "available_bytes": memory.available, "total_bytes": memory.total},
        "downloads_active": sum(1 for d in state.downloads.list() if d["status"] not in
                                ("done", "failed", "cancelled")),
    }
