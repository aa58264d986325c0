"""The real service `bench --adapt-stream` drives: started as a child on 127.0.0.1 in a data dir
of its own (so each kind of use starts from the shipped drafter), and asked over HTTP.

Boundary: process start and stop, one streamed chat request's figures, `/dflash/status`. The
child's data dir borrows the user's imported models and calibrations (read, never written), so a
start costs a load, not an import or a calibration.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import httpx

from dflash_local import paths
from dflash_local.errors import DFlashError

START_TIMEOUT_S = 1800.0  # a first load on a busy CPU (a calibration is minutes)
POLL_S = 0.5
SERVE = (sys.executable, "-m", "dflash_local.cli.main", "serve")


class RequestRefused(DFlashError):
    """The service answered a request with a 4xx: `message` is its own explanation."""

    def __init__(self, status: int, message: str):
        super().__init__(f"the service refused a request ({status}): {message}")
        self.status = status
        self.service_message = message


@dataclass(frozen=True)
class Reply:
    """One request's figures: the service's own, and the time to its first token here."""

    ttft_s: float
    tau: float
    tokens_per_s: float  # decode tokens per second (usage.dflash)
    completion_tokens: int
    drafter_version: int | None  # absent from a service that does not adapt: None too
    token_ids: tuple[int, ...]  # the reply's, to check speculative against plain


class ServiceClient:
    """A service's HTTP side: its status and one request's figures."""

    def __init__(self, url: str, api_key: str | None = None):
        self.url = url
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=url, timeout=httpx.Timeout(600.0, connect=5.0),
                                 headers=headers)

    def status(self) -> dict:
        answer = self.http.get("/dflash/status")
        answer.raise_for_status()
        return answer.json()

    def reply(self, fields: dict, *, speculative: bool, max_tokens: int, store: bool) -> Reply:
        """One streamed chat completion, greedy; `store: False` keeps it out of the recorded
        replies (held-out prompts and probes are never trained on)."""
        body = {**fields, "model": "default", "stream": True, "max_tokens": max_tokens,
                "temperature": 0, "speculative": speculative, "store": store,
                "stream_options": {"include_usage": True}}
        sent, first, usage, ids = time.monotonic(), None, None, []
        with self.http.stream("POST", "/v1/chat/completions", json=body) as answer:
            if answer.status_code >= 400:
                raise RequestRefused(answer.status_code, _error_message(answer.read().decode()))
            for payload in _events(answer):
                chunk_ids = (payload.get("dflash") or {}).get("token_ids") or ()
                if first is None and chunk_ids:
                    first = time.monotonic()
                ids.extend(chunk_ids)
                usage = payload.get("usage") or usage
        if usage is None or first is None:
            raise DFlashError("the service's stream ended without a token or without usage")
        dflash = usage.get("dflash") or {}
        version = dflash.get("drafter_version")
        return Reply(first - sent, float(dflash.get("tau", 1.0)),
                     float(dflash.get("decode_tokens_per_s", 0.0)), usage["completion_tokens"],
                     version if isinstance(version, int) else None, tuple(ids))

    def close(self) -> None:
        self.http.close()


class ServiceRun(ServiceClient):
    """A started `dflash-local serve` in data dir `home`; `close()` stops it (`with` does)."""

    def __init__(self, serve_args: list[str], home: Path):
        self.home = home
        self.log_path = home / "serve.log"
        api_key, port = secrets.token_urlsafe(16), _free_port()
        _borrow_user_data(home)
        env = {**os.environ, "DFLASH_LOCAL_HOME": str(home), "DFLASH_LOCAL_API_KEY": api_key}
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen([*SERVE, "--host", "127.0.0.1", "--port", str(port),
                                             "--no-prefix-cache", *serve_args],
                                            env=env, stdout=log, stderr=subprocess.STDOUT)
        super().__init__(f"http://127.0.0.1:{port}", api_key)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait_loaded(self, timeout_s: float = START_TIMEOUT_S) -> dict:
        """The status once a pair is loaded; a child that exits or never loads is an error
        that quotes its log."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise DFlashError(f"the service exited ({self.process.returncode}) before it "
                                  f"loaded: {self.log_tail()}")
            try:
                status = self.status()
                if status.get("loaded") and not status.get("loading"):
                    return status
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(POLL_S)
        raise DFlashError(f"the service did not load within {timeout_s:.0f} s: {self.log_tail()}")

    def log_tail(self, lines: int = 12) -> str:
        try:
            return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def close(self) -> None:
        super().close()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _events(answer: httpx.Response):
    for line in answer.iter_lines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            payload = json.loads(line[5:])
            if isinstance(payload.get("error"), dict):
                raise DFlashError(f"the service failed a reply: {payload['error'].get('message')}")
            yield payload


def _error_message(body: str) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:300]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _borrow_user_data(home: Path) -> None:
    """The user's imported models (linked) and calibrations (copied) in the child's data dir."""
    source = paths.data_dir_path()
    home.mkdir(parents=True, exist_ok=True)
    if (source / "models").is_dir() and not (home / "models").exists():
        (home / "models").symlink_to(source / "models", target_is_directory=True)
    if (source / "calibration").is_dir():
        shutil.copytree(source / "calibration", home / "calibration", dirs_exist_ok=True)
