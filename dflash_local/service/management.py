"""DFlash management: /health, /v1/models, the catalog with its will-it-fit figures, loading a
pair, the service's status, and hub downloads (started, listed, followed as SSE, cancelled).

Loads and catalog listings read files and may take seconds: they run in a thread, so the event
loop keeps serving the pair that is loaded.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import asdict

import psutil
from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from dflash_local.adapt.idle import disabled_status
from dflash_local.engines.local import LocalEngine
from dflash_local.errors import InvalidRequestError
from dflash_local.events import parse_block_size
from dflash_local.pairs.catalog import AVAILABLE, INCOMPLETE, ModelSpec, find_local
from dflash_local.pairs.memory_budget import engine_budgets
from dflash_local.pairs.pair_fit import ModelFiles, loaded_fit, pair_fits
from dflash_local.service.app_state import ServiceStateDep
from dflash_local.service.downloads import follow, public_snapshot
from dflash_local.service.management_schemas import DownloadRequest, LoadRequest
from dflash_local.service.sse import SSE_HEADERS, sse
from dflash_local.service.state import ServiceState

DEFAULT_FIT_CONTEXT = 8192  # the context the catalog's fit estimates are worked at, unless asked

router = APIRouter()


@router.get("/health")
async def health(state: ServiceStateDep) -> dict:
    loaded = state.loaded
    return {"status": "ok", "model": loaded.served_name if loaded else None,
            "loading": state.loading}


@router.get("/v1/models")
async def models(state: ServiceStateDep) -> dict:
    loaded = state.loaded
    # one entry: the loaded pair, named by `id` or an alias; every API also takes any name that
    # is not another catalog pair's (agents send their own: claude-sonnet-4-5, gpt-5-codex)
    data = [] if loaded is None else [{
        "id": loaded.served_name, "object": "model", "created": loaded.loaded_at,
        "owned_by": "dflash-local", "aliases": list(loaded.aliases), "any_name": True,
        "dflash": loaded.describe()}]
    return {"object": "list", "data": data}


@router.get("/dflash/catalog")
async def catalog(state: ServiceStateDep, context_tokens: int = DEFAULT_FIT_CONTEXT) -> dict:
    if not 1 <= context_tokens <= 1 << 22:
        raise InvalidRequestError(f"context_tokens {context_tokens} is not in [1, {1 << 22}]")
    budgets = await asyncio.to_thread(engine_budgets)
    return {"pairs": await asyncio.to_thread(_catalog_listing, state, budgets, context_tokens),
            "engines": {engine: budget.to_json() for engine, budget in budgets.items()},
            "context_tokens": context_tokens}


@router.post("/dflash/load")
async def load(body: LoadRequest, state: ServiceStateDep) -> dict:
    block_size = parse_block_size(body.block_size) if body.block_size is not None else None
    if body.pair is not None:
        await asyncio.to_thread(state.load_pair, body.pair, body.engine, block_size,
                                body.recalibrate, body.draft_window)
    else:
        await asyncio.to_thread(state.load_repos, body.engine, body.target,
                                body.drafter, block_size, body.recalibrate, body.draft_window)
    return _status(state)


@router.get("/dflash/status")
async def status(state: ServiceStateDep) -> dict:
    return _status(state)


@router.post("/dflash/downloads", status_code=202)
async def start_download(body: DownloadRequest, state: ServiceStateDep) -> dict:
    download = state.downloads.start(body.pair, body.context_tokens)
    return {**public_snapshot(download), "events": f"/dflash/downloads/{download.id}/events"}


@router.get("/dflash/downloads")
async def list_downloads(state: ServiceStateDep) -> dict:
    return {"downloads": state.downloads.list()}


@router.get("/dflash/downloads/{download_id}")
async def get_download(download_id: str, state: ServiceStateDep) -> dict:
    return public_snapshot(state.downloads.get(download_id))


@router.get("/dflash/downloads/{download_id}/events")
async def download_events(download_id: str, state: ServiceStateDep) -> StreamingResponse:
    download = state.downloads.get(download_id)
    return StreamingResponse(_sse(follow(download)), media_type="text/event-stream",
                             headers=SSE_HEADERS)


@router.delete("/dflash/downloads/{download_id}")
async def cancel_download(download_id: str, state: ServiceStateDep) -> dict:
    download = state.downloads.get(download_id)
    return {"id": download.id, "cancel_requested": download.cancel(), **public_snapshot(download)}


async def _sse(snapshots: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    async for snapshot in snapshots:
        yield sse(snapshot)
    yield sse("[DONE]")


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
        "adapt": loaded.adapt_status() if loaded else disabled_status(),
        "loading": state.loading,
        "loading_phase": state.loading_phase,
        "load_error": state.load_error,  # paths redacted when it was recorded
        "load_warning": state.load_warning,
        "capabilities": asdict(loaded.engine.capabilities) if loaded else None,
        "loaded_fit": _status_fit(loaded) if loaded else None,
        "worker": loaded.worker.status() if loaded else None,
        "calibration": loaded.engine.calibration_status() if loaded else None,
        "prefix_cache": (loaded.engine.prefix_cache_status()
                         if loaded and isinstance(loaded.engine, LocalEngine) else None),
        "memory": {"rss_bytes": psutil.Process().memory_info().rss,
                   "available_bytes": memory.available, "total_bytes": memory.total},
        "downloads_active": sum(1 for d in state.downloads.list() if d["status"] not in
                                ("done", "failed", "cancelled")),
    }
