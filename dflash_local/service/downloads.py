"""Downloads of catalog pairs, as the service runs them: start, follow (SSE), cancel.

Each download is a hub_download.Download in its own thread; its progress reaches an SSE client
through an asyncio queue fed with `call_soon_threadsafe`. Only catalog pairs can be downloaded: a
remote caller never names an arbitrary repo or a path.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

from dflash_local.errors import InvalidRequestError
from dflash_local.pairs.catalog import Catalog, PairSpec, find_local
from dflash_local.pairs.hub_download import TERMINAL_STATUSES, Download, RepoRef
from dflash_local.pairs.memory_budget import engine_budgets
from dflash_local.pairs.pair_fit import ModelFiles, pair_fits
from dflash_local.service.api_errors import NotFoundError
from dflash_local.service.validation import redact_paths

KEEP_FINISHED = 32  # finished downloads kept for GET .../events after the fact


class DownloadManager:
    def __init__(self, catalog: Catalog, endpoint: str | None = None,
                 cache_dir: str | Path | None = None):
        self.catalog = catalog
        self.endpoint = endpoint
        self.cache_dir = cache_dir
        self._downloads: dict[str, Download] = {}

    def start(self, pair_id: str, context_tokens: int = 4096) -> Download:
        """Start downloading a catalog pair's hub models; an active download of it is reused."""
        pair = self.catalog.get(pair_id)
        refs = [RepoRef(model.repo, model.revision, role)
                for role, model in (("target", pair.target), ("drafter", pair.drafter))
                if model.source == "hub"]
        if not refs:
            raise InvalidRequestError(f"pair {pair_id!r} ships with the app: nothing to download")
        for download in self._downloads.values():
            if download.label == pair_id and not download.finished:
                return download
        self._forget_old()
        download = Download(refs, cache_dir=self.cache_dir,
                            endpoint=self.endpoint, label=pair_id,
                            fit_of=partial(_listed_fit, pair, context_tokens, self.cache_dir))
        self._downloads[download.id] = download
        return download.start()

    def get(self, download_id: str) -> Download:
        download = self._downloads.get(download_id)
        if download is None:
            raise NotFoundError(f"no download {download_id!r}")
        return download

    def list(self) -> list[dict]:
        return [public_snapshot(download) for download in self._downloads.values()]

    def cancel_all(self) -> None:
        for download in self._downloads.values():
            download.cancel()

    def _forget_old(self) -> None:
        finished = [key for key, download in self._downloads.items() if download.finished]
        for key in finished[: max(0, len(finished) - KEEP_FINISHED + 1)]:
            del self._downloads[key]


def public_snapshot(download: Download, snapshot: dict | None = None) -> dict:
    """A download's state as callers see it: no server paths (where the files went is ours)."""
    shown = dict(snapshot or download.snapshot())
    shown.pop("paths", None)
    if shown.get("error"):
        shown["error"] = redact_paths(shown["error"])
    return shown


async def follow(download: Download) -> AsyncIterator[dict]:
    """Snapshots of `download` as it progresses, ending with its terminal one."""
    loop = asyncio.get_running_loop()
    updates: asyncio.Queue[dict] = asyncio.Queue()

    def on_update(snapshot: dict) -> None:  # called on the download's thread
        try:
            loop.call_soon_threadsafe(updates.put_nowait, snapshot)
        except RuntimeError:
            pass  # the loop is gone: nobody is listening any more

    unsubscribe = download.subscribe(on_update)  # before the first snapshot: nothing is missed
    try:
        snapshot = download.snapshot()
        yield public_snapshot(download, snapshot)
        while snapshot["status"] not in TERMINAL_STATUSES:
            snapshot = await updates.get()
            yield public_snapshot(download, snapshot)
    finally:
        unsubscribe()


def _listed_fit(pair: PairSpec, context_tokens: int, cache_dir, configs: dict[str, dict],
                weights: dict[str, int]) -> dict:
    """The pair's fit per engine from what the download listed (a role it does not fetch, a
    shipped drafter: its files here), worked out as the catalog works it (pair_fit.py)."""
    files = {}
    for role, model in (("target", pair.target), ("drafter", pair.drafter)):
        if role in configs:
            files[role] = ModelFiles(configs[role], weights.get(role) or None)
        else:
            files[role] = ModelFiles.read(find_local(model, cache_dir)[1])
    return pair_fits(pair, engine_budgets(pair.engines), context_tokens, files["target"], files["drafter"])
