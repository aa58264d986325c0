"""What the service owns: the loaded pair and its worker, the catalog, the downloads.

Loading is blocking (the app runs it in a thread), refuses to start while a generation runs, and
is transactional: the old pair serves until the new one is ready, and a failed load leaves it
serving. Names from remote callers are catalog ids or hub repo ids found in the local cache,
never paths, and what callers are told names no server path either.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from dflash_local.adapt.idle import Adaptation, adaptation_for, disabled_status
from dflash_local.adapt.record import ReplyRecorder, recorded_pair
from dflash_local.drafter.config import load_checked_drafter_config
from dflash_local.engines.interface import Engine
from dflash_local.engines.options import ENGINE_DEFAULTS, EngineOptions
from dflash_local.engines.table import LOCAL, PORTABLE, RELAY, engine_names, kind_of
from dflash_local.errors import (
    DFlashError,
    EngineUnavailableError,
    InvalidRequestError,
    ModelNotFoundError,
)
from dflash_local.events import AUTO, WHOLE_BLOCK, BlockSize, parse_block_size
from dflash_local.method.prefix_cache import machine_memory_bytes
from dflash_local.pairs.catalog import Catalog, load_catalog, locate
from dflash_local.pairs.hub import is_repo_id, resolve_model
from dflash_local.service.api_errors import BusyError, LoadFailedError, NoModelLoadedError
from dflash_local.service.downloads import DownloadManager
from dflash_local.service.prompt_count import PromptCounter
from dflash_local.service.scheduler import max_batch_for
from dflash_local.service.system_turns import SystemTurns
from dflash_local.service.validation import redact_paths
from dflash_local.service.worker import GenerationWorker

log = logging.getLogger("dflash_local.service")
Loader = Callable[[str, str, str | None, EngineOptions], Engine]  # (engine, target, drafter, options)
DEFAULT_NAMES = (None, "", "default")
WINDOWS_DRIVE = re.compile(r"^[A-Za-z]:[\\/]")


def check_model_name(name: str | None) -> None:
    """Refuse a model name that is a filesystem path: remote callers name models, not files.
    Judged by its shape alone: the answer never tells whether a path exists on the server."""
    if name in DEFAULT_NAMES:
        return
    is_path = (
        name.startswith(("/", "~", ".", "\\")) or ".." in name or "\\" in name or "\0" in name
        or os.path.isabs(name) or bool(WINDOWS_DRIVE.match(name))
    )
    if is_path or len(name) > 200:
        raise InvalidRequestError(f"{name[:200]!r} is not a known model (name a catalog pair or a "
                                  f"hub repo id; filesystem paths are not accepted)")


@dataclass
class LoadedPair:
    served_name: str
    engine: Engine
    worker: GenerationWorker
    pair_id: str | None = None
    default_block_size: BlockSize = WHOLE_BLOCK
    draft_window: int | None = None  # the drafter's context rows (None: unbounded)
    aliases: tuple[str, ...] = ()
    loaded_at: int = field(default_factory=lambda: int(time.time()))
    names: tuple[str, str | None] = ("", None)  # (target, drafter) as callers are told them
    status_fit: dict | None = None  # the fit /dflash/status shows: its files do not change
    prompt_counter: PromptCounter | None = None  # count_tokens' (None: the engine does not tokenize)
    # where its chat template takes system turns: tried at load, on the load's thread (a
    # template render is too slow for the event loop)
    system_turns: SystemTurns = SystemTurns.ANYWHERE
    recorder: ReplyRecorder | None = None  # its finished replies, kept for adaptation (adapt/)
    adaptation: Adaptation | None = None  # its drafter learning them while idle (adapt/idle.py)
    adapt_note: str | None = None  # why a recording pair does not adapt

    def adapt_status(self) -> dict:
        """/dflash/status's `adapt` (the contract in adapt/idle.py's `Adaptation.status`)."""
        if self.adaptation is not None:
            return self.adaptation.status()
        recording = self.recorder is not None and self.recorder.paused is None
        return disabled_status(recording=recording,
                               note=redact_paths(self.adapt_note) if self.adapt_note else None)

    def close(self) -> None:
        """Once its worker has stopped: the engine, the adaptation, the recorder's store."""
        self.engine.close()
        if self.adaptation is not None:
            self.adaptation.close()
        if self.recorder is not None:
            self.recorder.close()

    def answers_to(self, name: str | None) -> bool:
        return name in DEFAULT_NAMES or name == self.served_name or name in self.aliases

    def describe(self) -> dict:
        pair = self.engine.pair
        return {"served_name": self.served_name, "pair": self.pair_id, "engine": pair.engine,
                "target": self.names[0], "drafter": self.names[1], "dtype": pair.dtype,
                "drafter_block_size": pair.drafter_block,
                "default_block_size": self.default_block_size.request_value,
                "draft_window": self.draft_window,
                "max_context": self.engine.capabilities.max_context,  # the app's context meter
                "adapt": self.recorder.status() if self.recorder else {"recording": False}}


def public_name(name: str | Path | None) -> str | None:
    """A model's name for callers: a repo id or URL as it is, a local directory by its own name."""
    if name is None:
        return None
    text = str(name)
    return Path(text).name if os.path.isabs(text) or text.startswith(("~", ".")) else text


def _recommended(pair, engine: str) -> BlockSize | None:
    """The catalog's block size for the pair on this engine, if it names one."""
    size = pair.block_size_for(engine)
    return None if size is None else parse_block_size(size)


def pick_engine(requested: str | None, supported: tuple[str, ...] | None = None) -> str:
    """The engine asked for, else the installed one `engines.choose_engine` prefers, if it fits."""
    if requested not in (None, "auto"):
        known = engine_names()
        if requested not in known:
            raise InvalidRequestError(f"engine: unknown engine {requested!r} (known: auto, "
                                      f"{', '.join(known)})")
        return requested
    try:
        from dflash_local.engines import choose_engine

        chosen = choose_engine()
    except (ImportError, DFlashError):
        chosen = supported[0] if supported else PORTABLE.name
    return chosen if supported is None or chosen in supported else supported[0]


def default_loader(engine: str, target: str, drafter: str | None, options: EngineOptions) -> Engine:
    try:
        from dflash_local.engines import load_engine
    except ImportError as exc:
        raise EngineUnavailableError(f"engines cannot be loaded: {exc}") from None
    return load_engine(engine, target, drafter, options)


LOADING = "loading"  # a load's phase while the weights load (then calibrating, for block size auto)


class ServiceState:
    def __init__(self, *, catalog: Catalog | None = None, loader: Loader | None = None,
                 api_key: str | None = None, max_queue: int = 8, max_batch: int | None = None,
                 hub_endpoint: str | None = None,
                 hub_cache_dir: str | Path | None = None,
                 load_options: dict[str, EngineOptions] | None = None,
                 on_loading_phase: Callable[[str, str], None] | None = None, adapt: bool = True):
        self.adapt = adapt  # record local pairs' finished replies (serve --no-adapt: off)
        self.catalog = catalog or load_catalog()
        # engine name -> its options (dtype, a served engine's URLs): the `serve` flags reach
        # the engine they were given for, never another loaded later
        self.load_options = dict(load_options or {})
        self.loader = loader or default_loader
        self.api_key = api_key
        self.max_queue = max_queue
        self.max_batch = max_batch  # generations in flight (None: scheduler.max_batch_for's default)
        self.loaded: LoadedPair | None = None
        self.loading: str | None = None
        self.loading_phase: str | None = None  # "loading", then "calibrating" when it measures
        self.load_error: str | None = None
        self.load_warning: str | None = None
        self.hub_cache_dir = hub_cache_dir
        self.downloads = DownloadManager(self.catalog, endpoint=hub_endpoint, cache_dir=hub_cache_dir)
        self.on_loading_phase = on_loading_phase  # (served name, phase): `serve` prints it
        self._load_lock = threading.Lock()

    def require_model(self, name: str | None) -> LoadedPair:
        """The loaded pair for any name but another known pair's: clients send their own model
        names (Claude Code's opus/sonnet/haiku slots, Codex's gpt-5), and one pair serves here."""
        check_model_name(name)
        loaded = self.loaded  # while another loads, this one still serves
        if loaded is None:
            raise NoModelLoadedError(
                f"{self.loading} is loading; retry when GET /dflash/status shows it" if self.loading
                else "no model is loaded; POST /dflash/load first")
        if not loaded.answers_to(name) and name in self.other_pairs_names():
            raise ModelNotFoundError(f"model {name!r} is not loaded (this server serves "
                                     f"{loaded.served_name!r})")
        return loaded

    def other_pairs_names(self) -> set[str]:
        """The names that ask for a pair this service knows: its catalog's ids and targets."""
        return {name for pair in self.catalog.pairs for name in (pair.id, pair.target.repo)}

    # --- blocking: the app calls these in a thread ---

    def load_pair(self, pair_id: str, engine: str | None = None,
                  block_size: BlockSize | None = None, recalibrate: bool = False,
                  draft_window: int | None = None) -> LoadedPair:
        pair = self.catalog.get(pair_id)
        self._ensure_idle()  # before any slow preparation (the embedded import)
        engine = pick_engine(engine, pair.engines)
        if engine not in pair.engines:
            raise InvalidRequestError(f"pair {pair_id!r} runs on {', '.join(pair.engines)}, "
                                      f"not on engine {engine!r}")
        if kind_of(engine) == LOCAL:  # it loads from local directories
            target = self._locate_target(pair)
            drafter, warning = self._locate_drafter(pair)
        else:  # a served engine fetches the models itself
            target, drafter, warning = pair.target.repo, pair.drafter.repo, None
        return self.load(engine, target, drafter, served_name=pair.id, pair_id=pair.id,
                         block_size=block_size or _recommended(pair, engine),
                         aliases=(pair.target.repo,), warning=warning, recalibrate=recalibrate,
                         names=(pair.target.repo, pair.drafter.repo if drafter else None),
                         draft_window=draft_window or pair.draft_window)

    def _locate_target(self, pair) -> Path:
        """The target's directory. The embedded target is imported first, once (minutes on a
        CPU): a loading phase of its own, so a client can say what the wait is."""
        from dflash_local.pairs import embedded  # lazy: it pulls in the GGUF reader

        importing = (pair.target.source == "embedded" and self.loading is None
                     and not embedded.is_complete_import(embedded.embedded_target_dir()))
        if not importing:
            return locate(pair.target, prepare=True, cache_dir=self.hub_cache_dir)
        self.loading = pair.id
        try:
            self._set_loading_phase(embedded.IMPORTING)
            target = locate(pair.target, prepare=True, cache_dir=self.hub_cache_dir)
            self._set_loading_phase(LOADING)  # the import is over: what follows is the load
            return target
        finally:
            self.loading = self.loading_phase = None

    def _locate_drafter(self, pair) -> tuple[Path | None, str | None]:
        try:
            return locate(pair.drafter, cache_dir=self.hub_cache_dir), None
        except ModelNotFoundError as exc:
            if pair.drafter.source != "shipped":
                raise
            # the app's own pair still serves, plainly, until its drafter ships (as the CLI does)
            log.warning("%s: decoding without speculation", exc)
            return None, f"{exc}: decoding without speculation"

    def load_repos(self, engine: str | None, target: str, drafter: str | None,
                   block_size: BlockSize | None = None, recalibrate: bool = False,
                   draft_window: int | None = None) -> LoadedPair:
        if kind_of(engine) == RELAY:  # a caller must not point the relay at a URL of its choosing
            raise InvalidRequestError(f"engine: {engine!r} relays the server given to serve "
                                      f"--base-url; POST /dflash/load cannot load it")
        engine = pick_engine(engine)
        self._ensure_idle()
        for name in (target, drafter):
            if name is not None:
                check_model_name(name)
                if not is_repo_id(name):
                    raise InvalidRequestError(f"{name!r} is not a known model (not a hub repo id)")
        if kind_of(engine) == LOCAL:  # it loads from local directories
            cache = self.hub_cache_dir
            target_path = resolve_model(target, local_only=True, cache_dir=cache)
            drafter_path = resolve_model(drafter, local_only=True, cache_dir=cache) if drafter else None
        else:
            target_path, drafter_path = target, drafter
        return self.load(engine, target_path, drafter_path, served_name=target, block_size=block_size,
                         recalibrate=recalibrate, names=(target, drafter),
                         draft_window=draft_window)

    def load(self, engine: str, target: str | Path, drafter: str | Path | None, *,
             served_name: str, pair_id: str | None = None, block_size: BlockSize | None = None,
             aliases: tuple[str, ...] = (), warning: str | None = None,
             recalibrate: bool = False, names: tuple[str, str | None] | None = None,
             draft_window: int | None = None) -> LoadedPair:
        """Load this pair, then put it in place of the current one, which serves meanwhile and
        stays if the load fails (local paths are trusted: CLI and internal). A local pair with
        no block size given defaults to auto (calibrated widths); `recalibrate` measures this
        machine again (a first measurement disturbed by other work); `draft_window` bounds the
        drafter's context (the engine checks it against the target's)."""
        options = self.load_options.get(engine, ENGINE_DEFAULTS)
        if draft_window is not None:
            if kind_of(engine) == RELAY:
                raise InvalidRequestError(f"draft_window {draft_window}: a relayed server keeps its "
                                          f"own draft window (set it where that server starts)")
            options = replace(options, draft_window=draft_window)
        if block_size is None:
            block_size = AUTO if kind_of(engine) == LOCAL and drafter is not None else WHOLE_BLOCK
        if not self._load_lock.acquire(blocking=False):
            raise BusyError("another load is in progress")
        try:
            self.loading = served_name
            self.loading_phase = LOADING
            self._ensure_idle()
            precheck_pair(target, drafter)
            engine_obj, max_batch = self._load_engine(engine, target, drafter, block_size,
                                                      recalibrate, options)
            names = names or (public_name(target), public_name(drafter))
            recorder = (ReplyRecorder(recorded_pair(engine_obj.pair, names))
                        if self.adapt and kind_of(engine) == LOCAL else None)
            adaptation, note = adaptation_for(engine_obj, recorder)
            worker = GenerationWorker(engine_obj, max_queue=self.max_queue, max_batch=max_batch,
                                      on_finished=recorder.record if recorder else None,
                                      idle_work=adaptation)
            loaded = LoadedPair(served_name=served_name, engine=engine_obj, worker=worker,
                                prompt_counter=PromptCounter.of(engine_obj, worker.tool_support),
                                system_turns=SystemTurns.of(engine_obj),
                                pair_id=pair_id, default_block_size=block_size, aliases=aliases,
                                draft_window=draft_window, names=names, recorder=recorder,
                                adaptation=adaptation, adapt_note=note)
            previous, self.loaded = self.loaded, loaded
            self.load_error, self.load_warning = None, warning
            if previous is not None:
                previous.worker.retire(on_idle=previous.close)
            return loaded
        finally:
            self.loading = self.loading_phase = None
            self._load_lock.release()

    def _load_engine(self, engine: str, target: str | Path, drafter: str | Path | None,
                     block_size: BlockSize, recalibrate: bool,
                     options: EngineOptions) -> tuple[Engine, int]:
        """The loaded engine and the generations its worker keeps in flight."""
        engine_obj = None
        try:
            engine_obj = self.loader(engine, str(target), str(drafter) if drafter else None,
                                     options)
            max_batch = max_batch_for(engine_obj, self.max_batch, machine_memory_bytes())
            # the first chat would wait for it otherwise, with nothing on screen to say why
            engine_obj.prepare(block_size, on_wait=self._set_loading_phase, recalibrate=recalibrate)
            _preload(engine_obj)
            return engine_obj, max_batch
        except Exception as exc:
            self.load_error = redact_paths(f"{type(exc).__name__}: {exc}")
            if engine_obj is not None:
                _close_quietly(engine_obj)
            if isinstance(exc, DFlashError):
                raise
            log.exception("loading %s failed", target)
            still = f"; {self.loaded.served_name} still serves" if self.loaded else ""
            raise LoadFailedError(f"the load failed ({self.load_error}){still}") from None

    def _set_loading_phase(self, phase: str) -> None:
        self.loading_phase = phase
        if self.on_loading_phase is not None and self.loading is not None:
            self.on_loading_phase(self.loading, phase)

    def _ensure_idle(self) -> None:
        if self.loaded is not None and self.loaded.worker.busy:
            raise BusyError("a generation is running or queued; load again when it is done")

    def unload(self) -> None:
        loaded, self.loaded = self.loaded, None
        if loaded is not None:
            loaded.worker.close()
            loaded.close()

    def shutdown(self) -> None:
        self.downloads.cancel_all()
        self.unload()


def _close_quietly(engine: Engine) -> None:
    """Free a half-loaded engine without hiding why its load failed."""
    try:
        engine.close()
    except Exception:
        log.exception("closing the engine after a failed load failed too")


def precheck_pair(target: str | Path, drafter: str | Path | None) -> None:
    """The config-level compatibility check, before the current pair is unloaded."""
    if drafter is None or not Path(target).is_dir() or not Path(drafter).is_dir():
        return
    load_checked_drafter_config(drafter, target)


def _preload(engine) -> None:
    """An agent's fixed prefix, warm from the first request: a speed-up only, so a failure to
    read the disk tier costs that speed-up, never the load."""
    try:
        engine.preload_prefix_cache()
    except Exception:
        log.exception("reading the prefix cache's disk entries into memory failed; serving without")
