"""Downloads from the Hugging Face hub into its cache, one background thread per request, with
progress and cancel; the pair's compatibility is checked from its config.json files before any
weights are fetched.

Boundary: the thread, its state and its listeners. Names and the hub's errors are hub.py's, the
memory estimate the caller's (`fit_of`: service/downloads.py hands in pair_fit.py's, the figure
the catalog shows); serving the progress to clients is service/downloads.py's.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dflash_local.drafter.config import (
    check_compatible,
    parse_drafter_config,
    target_info_from_config,
)
from dflash_local.errors import DFlashError, IncompatiblePairError, ModelNotFoundError
from dflash_local.pairs.hub import HUB_ERRORS, WEIGHT_PATTERNS, hub_error, is_repo_id
from dflash_local.pairs.snapshot_manifest import write_manifest

TERMINAL_STATUSES = ("done", "failed", "cancelled")
# (config.json by role, weights' bytes by role) -> the snapshot's `fit`, from the listing alone
FitOf = Callable[[dict[str, dict], dict[str, int]], dict]
PROGRESS_EVERY_S = 0.1  # listeners hear at most ~10 progress events a second


class DownloadCancelled(DFlashError):
    code = "download_cancelled"


class DownloadRefused(DFlashError):
    """A download that would not fit on disk."""

    code = "download_refused"


@dataclass(frozen=True)
class RepoRef:
    repo: str
    revision: str | None = None
    role: str = "target"  # "target" | "drafter"


class Download:
    """Fetch repos into the Hugging Face cache in a thread: configs, compatibility, plan, weights.

    Cancel sets a flag that the progress hook checks on every chunk; the exception it raises
    unwinds huggingface_hub. huggingface_hub >= 2.x writes each file to a per-attempt
    `<etag>.<random>.incomplete` file, moves it into `blobs/` only when complete and deletes it on
    any failure: a cancelled file leaves nothing behind and the cache never holds a half blob.
    Resuming is per file: files already complete are skipped by the next download; a file cut
    off mid-way starts over (huggingface_hub resumes with Range only across retries in one call).
    Once every listed file is in at its size, each snapshot's manifest is written
    (snapshot_manifest.py); until then the snapshot is "incomplete: resume or delete".
    """

    def __init__(self, repos: list[RepoRef], *, cache_dir: str | Path | None = None,
                 endpoint: str | None = None, label: str = "", fit_of: FitOf | None = None):
        for ref in repos:
            if not is_repo_id(ref.repo):
                raise ModelNotFoundError(f"{ref.repo!r} is not a hub repo id (owner/name)")
        self.id = uuid.uuid4().hex[:12]
        self.label = label or " + ".join(ref.repo for ref in repos)
        self.repos = tuple(repos)
        self.fit_of = fit_of  # None: the snapshot's `fit` stays None
        self.cache_dir = str(cache_dir) if cache_dir is not None else None
        self.endpoint = endpoint
        self._cancel = threading.Event()
        self._finished = threading.Event()
        self._lock = threading.Lock()
        self._listeners: list[Callable[[dict], None]] = []
        self._last_emit = 0.0
        self._state = {"id": self.id, "label": self.label, "status": "pending", "bytes_done": 0,
                       "bytes_total": None, "files_done": 0, "repo": None, "fit": None,
                       "paths": {}, "error": None, "error_code": None}
        self._listing: dict[str, list] = {}  # role -> the dry run's files: the manifest
        self._thread = threading.Thread(target=self._run, name=f"download-{self.id}", daemon=True)

    # --- control, from any thread ---

    def start(self) -> Download:
        self._thread.start()
        return self

    def cancel(self) -> bool:
        """Ask the download to stop; False when it had already finished."""
        if self._finished.is_set():
            return False
        self._cancel.set()
        return True

    def wait(self, timeout: float | None = None) -> bool:
        return self._finished.wait(timeout)

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    def snapshot(self) -> dict:
        with self._lock:
            return json.loads(json.dumps(self._state))

    def subscribe(self, listener: Callable[[dict], None]) -> Callable[[], None]:
        """Call `listener(snapshot)` from the download thread on progress; returns unsubscribe."""
        with self._lock:
            self._listeners.append(listener)

        def unsubscribe() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)
        return unsubscribe

    # --- the thread ---

    def _run(self) -> None:
        outcome = {"status": "done"}
        try:
            files = self._list_files()  # first: an unreachable hub fails here, without retries
            configs = self._fetch_configs()
            _check_pair(self.repos, configs)  # before any weights
            self._check_room(files, configs)
            self._fetch_weights()
            self._write_manifests()
        except DownloadCancelled:
            outcome = {"status": "cancelled", "error": "cancelled by the client",
                       "error_code": "cancelled"}
        except DFlashError as exc:
            outcome = {"status": "failed", "error": str(exc), "error_code": exc.code}
        except Exception as exc:  # noqa: BLE001 - the thread's edge: report, never die silently
            outcome = {"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                       "error_code": "download_error"}
        finally:
            # finished before anyone hears the outcome: a listener that starts the same
            # download again on "failed" gets a new one, not this one back
            with self._lock:
                self._state.update(outcome)
            self._finished.set()
            self._emit(force=True)

    def _fetch_configs(self) -> dict[str, dict]:
        from huggingface_hub import hf_hub_download

        configs = {}
        for ref in self.repos:
            self._check_cancel()
            self._update(repo=ref.repo)
            try:
                path = hf_hub_download(ref.repo, "config.json", revision=ref.revision,
                                       cache_dir=self.cache_dir, endpoint=self.endpoint)
            except HUB_ERRORS as exc:  # translated into one clear message
                raise hub_error(ref.repo, exc) from None
            configs[ref.role] = json.loads(Path(path).read_text())
        return configs

    def _list_files(self) -> list:
        """The files to fetch (huggingface_hub's dry run: sizes, and whether each is cached)."""
        from huggingface_hub import snapshot_download

        self._update(status="checking")
        files = []
        for ref in self.repos:
            self._check_cancel()
            self._update(repo=ref.repo)
            try:
                self._listing[ref.role] = snapshot_download(ref.repo, revision=ref.revision, cache_dir=self.cache_dir,
                                           endpoint=self.endpoint, allow_patterns=WEIGHT_PATTERNS,
                                           dry_run=True, tqdm_class=_progress_bar_class(self, False))
            except HUB_ERRORS as exc:
                raise hub_error(ref.repo, exc) from None
            files += self._listing[ref.role]
        return files

    def _check_room(self, files: list, configs: dict[str, dict]) -> None:
        """Disk space is a hard limit; memory (weights + KV cache) is reported in `fit`."""
        # config.json files are in the cache by now (fetched for the compatibility check)
        to_fetch = sum(f.file_size or 0 for f in files if f.will_download and f.filename != "config.json")
        weights = {role: sum(f.file_size or 0 for f in listed if f.filename.endswith(".safetensors"))
                   for role, listed in self._listing.items()}
        fit = self.fit_of(configs, weights) if self.fit_of is not None else None
        self._update(bytes_total=to_fetch, fit=fit)
        cache = Path(self.cache_dir) if self.cache_dir else _default_cache_dir()
        free = shutil.disk_usage(_existing_parent(cache)).free
        if to_fetch > free:
            raise DownloadRefused(f"the download needs {to_fetch / 1e9:.2f} GB and only "
                                  f"{free / 1e9:.2f} GB are free in {cache}")

    def _fetch_weights(self) -> None:
        from huggingface_hub import snapshot_download

        self._update(status="downloading")
        bar_class = _progress_bar_class(self)
        for ref in self.repos:
            self._check_cancel()
            self._update(repo=ref.repo)
            try:
                path = snapshot_download(ref.repo, revision=ref.revision, cache_dir=self.cache_dir,
                                         endpoint=self.endpoint, allow_patterns=WEIGHT_PATTERNS,
                                         tqdm_class=bar_class, max_workers=4)
            except HUB_ERRORS as exc:
                raise hub_error(ref.repo, exc) from None
            with self._lock:
                self._state["paths"][ref.role] = path

    def _write_manifests(self) -> None:
        """Each snapshot is complete once every listed file is there at its listed size."""
        for ref in self.repos:
            snapshot = Path(self._state["paths"][ref.role])
            write_manifest(snapshot, {info.filename: info.file_size
                                      for info in self._listing[ref.role]})

    # --- progress plumbing ---

    def _check_cancel(self) -> None:
        if self._cancel.is_set():
            raise DownloadCancelled(f"download {self.id} cancelled")

    def _on_bytes(self, count: float) -> None:
        self._check_cancel()
        with self._lock:
            self._state["bytes_done"] += int(count)
        self._emit()

    def _on_file(self) -> None:
        with self._lock:
            self._state["files_done"] += 1
        self._check_cancel()
        self._emit()

    def _update(self, **changes) -> None:
        with self._lock:
            self._state.update(changes)
        self._emit(force="status" in changes)

    def _emit(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_emit < PROGRESS_EVERY_S:
            return
        self._last_emit = now
        snapshot = self.snapshot()
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener(snapshot)


def _progress_bar_class(download: Download, report: bool = True):
    """A silent tqdm for snapshot_download's bars that reports to `download` and cancels it."""
    from tqdm.std import tqdm

    class ProgressBar(tqdm):
        def __init__(self, *args, **kwargs):
            desc = str(kwargs.get("desc") or "")
            # snapshot_download's bars: "Fetching N files" (files), "Reconstructing..." (bytes
            # written, resumed bytes included), "Downloading bytes" (network; not counted)
            self._kind = "files" if desc.startswith("Fetching") else (
                "bytes" if desc.startswith("Reconstructing") else "other")
            if not report:
                self._kind = "other"
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def update(self, n=1):
            if self._kind == "bytes":
                download._on_bytes(n or 0)
            elif self._kind == "files":
                download._on_file()
            else:
                download._check_cancel()

        @property
        def format_dict(self):
            return {}

        def set_postfix_str(self, s="", refresh=True):
            pass

    return ProgressBar


def _check_pair(repos: tuple[RepoRef, ...], configs: dict[str, dict]) -> None:
    """The compatibility check on the downloaded config.json files, before any weights."""
    if "target" not in configs or "drafter" not in configs:
        return

    drafter_repo = next(ref.repo for ref in repos if ref.role == "drafter")
    drafter = parse_drafter_config(configs["drafter"], source=f"{drafter_repo}/config.json")
    reasons = check_compatible(drafter, target_info_from_config(configs["target"]))
    if reasons:
        raise IncompatiblePairError(reasons)


def _default_cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
