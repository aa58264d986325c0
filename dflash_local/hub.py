"""Model names to local directories, and downloads, through huggingface_hub (its cache, HF_HOME,
offline mode). A name is a local directory or a hub repo id.

Boundary: resolve names; estimate whether a pair fits in memory; run a download in a thread with
progress and cancel, checking the pair's compatibility from its config.json files before any
weights are fetched. Loading is the engines' job.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from dflash_local.drafter.config import (
    check_compatible,
    parse_drafter_config,
    target_info_from_config,
)
from dflash_local.errors import DFlashError, IncompatiblePairError, ModelNotFoundError

REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
WEIGHT_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt", "*.tiktoken"]


def is_repo_id(name: str) -> bool:
    return bool(REPO_ID.match(name)) and ".." not in name


def resolve_model(name: str, revision: str | None = None, local_only: bool = False,
                  cache_dir: str | Path | None = None) -> Path:
    """A local directory as it is; a repo id from the hub cache, downloading unless local_only."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path.resolve()
    if not is_repo_id(name):
        raise ModelNotFoundError(f"{name!r} is neither a local directory nor a hub repo id (owner/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(name, revision=revision, allow_patterns=WEIGHT_PATTERNS,
                                      local_files_only=True, cache_dir=cache_dir))
    except LocalEntryNotFoundError:
        if local_only:
            raise ModelNotFoundError(f"{name} is not in the local Hugging Face cache") from None
    try:
        return Path(snapshot_download(name, revision=revision, allow_patterns=WEIGHT_PATTERNS,
                                      cache_dir=cache_dir))
    except RepositoryNotFoundError:
        raise ModelNotFoundError(f"the Hugging Face hub has no repo {name!r} (or it is gated)") from None
    except LocalEntryNotFoundError:
        raise ModelNotFoundError(
            f"cannot download {name}: the Hugging Face hub is unreachable (offline) and the repo "
            f"is not in the local cache"
        ) from None
    except OSError as exc:
        raise ModelNotFoundError(f"cannot download {name}: {exc}") from None


# --- "will it fit": weights + KV cache against this machine's memory ---

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}


def kv_cache_bytes(config: dict, context_tokens: int, dtype_bytes: int | None = None) -> int:
    """2 (K and V) * attention layers * kv_heads * head_dim * context * dtype bytes.

    Linear-attention (recurrent) layers hold no KV; sliding layers hold at most their window.
    """
    text = config.get("text_config") or config
    heads = int(text.get("num_attention_heads", 1))
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or text["hidden_size"] // heads)
    if dtype_bytes is None:
        dtype_bytes = DTYPE_BYTES.get(str(text.get("torch_dtype") or text.get("dtype")), 2)
    layer_types = text.get("layer_types") or ["full_attention"] * int(text["num_hidden_layers"])
    window = text.get("sliding_window") or context_tokens
    rows = 0
    for layer_type in layer_types:
        if layer_type == "linear_attention":
            continue
        rows += min(context_tokens, window) if layer_type == "sliding_attention" else context_tokens
    return 2 * kv_heads * head_dim * rows * dtype_bytes


@dataclass(frozen=True)
class FitEstimate:
    weights_bytes: int
    kv_bytes: int
    context_tokens: int
    available_bytes: int  # memory available now (psutil)

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.available_bytes

    def to_json(self) -> dict:
        return {**asdict(self), "total_bytes": self.total_bytes, "fits": self.fits}


def estimate_fit(weights_bytes: int, target_config: dict, context_tokens: int = 4096,
                 available_bytes: int | None = None) -> FitEstimate:
    if available_bytes is None:
        import psutil

        available_bytes = int(psutil.virtual_memory().available)
    return FitEstimate(weights_bytes=int(weights_bytes),
                       kv_bytes=kv_cache_bytes(target_config, context_tokens),
                       context_tokens=context_tokens, available_bytes=available_bytes)


# --- downloads: one background thread per request, progress and cancel through tqdm_class ---

TERMINAL_STATUSES = ("done", "failed", "cancelled")
PROGRESS_EVERY_S = 0.1  # listeners hear at most ~10 progress events a second


# what huggingface_hub raises for a missing, gated, unreachable or offline repo (its HTTP and
# cache errors are OSErrors; a malformed repo id is a ValueError)
HUB_ERRORS = (OSError, ValueError)


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
    """

    def __init__(self, repos: list[RepoRef], *, context_tokens: int = 4096,
                 cache_dir: str | Path | None = None, endpoint: str | None = None, label: str = ""):
        for ref in repos:
            if not is_repo_id(ref.repo):
                raise ModelNotFoundError(f"{ref.repo!r} is not a hub repo id (owner/name)")
        self.id = uuid.uuid4().hex[:12]
        self.label = label or " + ".join(ref.repo for ref in repos)
        self.repos = tuple(repos)
        self.context_tokens = context_tokens
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
        try:
            files = self._list_files()  # first: an unreachable hub fails here, without retries
            configs = self._fetch_configs()
            _check_pair(self.repos, configs)  # before any weights
            self._check_room(files, configs)
            self._fetch_weights()
            self._update(status="done")
        except DownloadCancelled:
            self._update(status="cancelled", error="cancelled by the client", error_code="cancelled")
        except DFlashError as exc:
            self._update(status="failed", error=str(exc), error_code=exc.code)
        except Exception as exc:  # noqa: BLE001 - the thread's edge: report, never die silently
            self._update(status="failed", error=f"{type(exc).__name__}: {exc}", error_code="download_error")
        finally:
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
                files += snapshot_download(ref.repo, revision=ref.revision, cache_dir=self.cache_dir,
                                           endpoint=self.endpoint, allow_patterns=WEIGHT_PATTERNS,
                                           dry_run=True, tqdm_class=_progress_bar_class(self, False))
            except HUB_ERRORS as exc:
                raise hub_error(ref.repo, exc) from None
        return files

    def _check_room(self, files: list, configs: dict[str, dict]) -> None:
        """Disk space is a hard limit; memory (weights + KV cache) is reported in `fit`."""
        # config.json files are in the cache by now (fetched for the compatibility check)
        to_fetch = sum(f.file_size or 0 for f in files if f.will_download and f.filename != "config.json")
        weights = sum(f.file_size or 0 for f in files if f.filename.endswith(".safetensors"))
        fit = estimate_fit(weights, configs["target"], self.context_tokens) if "target" in configs else None
        self._update(bytes_total=to_fetch, fit=fit.to_json() if fit else None)
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


def hub_error(repo: str, exc: Exception) -> ModelNotFoundError:
    """One clear message for what huggingface_hub raised while fetching `repo`."""
    from huggingface_hub.errors import DryRunError

    if isinstance(exc, DryRunError) and exc.__cause__ is not None:
        exc = exc.__cause__  # the dry run wraps the error it met listing the repo
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, GatedRepoError):
        return ModelNotFoundError(f"{repo} is gated on the Hugging Face hub: accept its license "
                                  f"and log in with an HF token")
    if isinstance(exc, RepositoryNotFoundError):
        return ModelNotFoundError(f"the Hugging Face hub has no repo {repo!r} (or it is private)")
    if isinstance(exc, RevisionNotFoundError):
        return ModelNotFoundError(f"{repo} has no such revision: {exc}")
    if constants.HF_HUB_OFFLINE:
        return ModelNotFoundError(f"cannot download {repo}: offline mode is on (HF_HUB_OFFLINE=1) "
                                  f"and it is not in the local cache")
    if isinstance(exc, HfHubHTTPError):
        return ModelNotFoundError(f"cannot download {repo}: the hub answered {exc}")
    if isinstance(exc, LocalEntryNotFoundError) or "connect" in type(exc).__name__.lower():
        return ModelNotFoundError(f"cannot download {repo}: the Hugging Face hub is unreachable "
                                  f"and it is not in the local cache")
    return ModelNotFoundError(f"cannot download {repo}: {type(exc).__name__}: {exc}")


def _default_cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
