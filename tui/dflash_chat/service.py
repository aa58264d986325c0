"""The dflash-local service as the app's child process: start, wait until it answers, stop.

Boundary: no Textual, no model code: it runs `python -m dflash_local.cli.main serve` on a free
loopback port (port 0, read back from the line serve prints) with a random API key passed
through the environment (not argv, which other users can read in `ps`), and the app's pid, which
the service watches: killed, the app takes its service with it within a second or so. The
child's stderr and stdout go to a log file (both appending) whose tail explains a failed start
or a dead service.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_chat.protocol import (
    PHASE_CALIBRATING,
    PHASE_IMPORTING,
    PHASE_LOADING,
    ServiceError,
)

if TYPE_CHECKING:
    from dflash_chat.client import DFlashClient

SERVE_COMMAND = (sys.executable, "-m", "dflash_local.cli.main", "serve")
API_KEY_ENV = "DFLASH_LOCAL_API_KEY"  # read by `serve --api-key`'s default
PARENT_PID_ENV = "DFLASH_LOCAL_PARENT_PID"  # the service ends soon after the app is gone
SERVING_LINE = re.compile(r"serving .* on (http://\S+)")
# a long wait before it, named
PHASE_LINE = re.compile(
    rf"^dflash-local ((?:{PHASE_IMPORTING}|{PHASE_LOADING}|{PHASE_CALIBRATING}) \S+)")
STOP_TIMEOUT_S = 10.0
HEALTH_TIMEOUT_S = 30.0
HEALTH_EVERY_S = 2.0  # how often the app checks that its service still answers
LOG_TAIL_LINES = 2  # what a toast shows of the log: its last state and the error
LOG_LINE_CHARS = 100  # each cut here (a traceback's last line says enough)
PROGRESS_BAR = re.compile(r"\d+%\|")  # tqdm's "NN%|███  |": a start's progress, noise after it
TRACEBACK_FRAME = re.compile(r"^(Traceback \(most recent call last\):|\s)")  # header, frames
TERMINAL_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # a bar's cursor moves and colours


class ServiceStartError(Exception):
    pass


def fresh_log(path: Path) -> Path:
    """`path`, emptied; where the data dir cannot be written (read-only, full), this start's
    log in the temporary dir instead, and else none: the service starts all the same."""
    elsewhere = Path(tempfile.gettempdir()) / f"dflash-local-service-{os.getpid()}.log"
    for candidate in (path, elsewhere):
        try:
            candidate.parent.mkdir(parents=True, exist_ok=True)
            candidate.write_bytes(b"")
            return candidate
        except OSError:
            continue
    return Path(os.devnull)


class ServiceProcess:
    """One child service. `serve_args` are passed through (--target, --drafter, --pair...)."""

    def __init__(self, serve_args: list[str], log_path: Path, env: dict[str, str] | None = None,
                 command: tuple[str, ...] | None = None,
                 on_phase: Callable[[str], None] | None = None):
        self.serve_args = list(serve_args)
        self.on_phase = on_phase  # called with "importing ...", "calibrating ..." as they start
        self.log_path = log_path
        self.api_key = secrets.token_urlsafe(24)
        self.url: str | None = None
        self.command = command or SERVE_COMMAND
        self._env = {**os.environ, **(env or {}), API_KEY_ENV: self.api_key,
                     PARENT_PID_ENV: str(os.getpid()), "PYTHONUNBUFFERED": "1"}
        self._process: asyncio.subprocess.Process | None = None
        self._stdout_task: asyncio.Task | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def exit_status(self) -> str:
        code = self._process.returncode if self._process is not None else None
        return "still running" if code is None else (
            f"killed by signal {-code}" if code < 0 else f"exit status {code}")

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.returncode is None

    async def start(self) -> str:
        """Start the child and return its URL once it prints it (after the pair has loaded)."""
        self.log_path = fresh_log(self.log_path)  # one log per start; both writers then append
        with self._open_log() as log:  # the child keeps its own descriptor
            self._process = await asyncio.create_subprocess_exec(
                *self.command, "--host", "127.0.0.1", "--port", "0", *self.serve_args,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=log,
                env=self._env)  # same session: closing the terminal ends the child too
        self.url = await self._read_url()
        self._stdout_task = asyncio.create_task(self._drain_stdout())
        return self.url

    def _open_log(self):
        return open(self.log_path, "ab")

    def _log_line(self, line: bytes) -> None:
        with contextlib.suppress(OSError), self._open_log() as log:  # a full disk: lines lost
            log.write(line)

    async def _read_url(self) -> str:
        assert self._process is not None and self._process.stdout is not None
        while line := await self._process.stdout.readline():
            self._log_line(line)
            text = line.decode(errors="replace").strip()
            if match := SERVING_LINE.search(text):
                return match.group(1)
            if (phase := PHASE_LINE.match(text)) and self.on_phase is not None:
                self.on_phase(phase.group(1))
        await self._process.wait()
        raise ServiceStartError(f"the service exited with status {self._process.returncode} "
                                f"before serving:\n{self.log_tail()}")

    async def wait_healthy(self, client: DFlashClient, timeout: float = HEALTH_TIMEOUT_S) -> dict:
        """Poll /health until it answers (uvicorn starts just after serve prints its URL)."""
        try:
            return await wait_healthy(client, timeout, alive=lambda: self.running)
        except ServiceStartError as exc:
            raise ServiceStartError(f"{exc}:\n{self.log_tail()}") from None

    async def _drain_stdout(self) -> None:
        """Keep reading the child's stdout into the log, so a full pipe never blocks it."""
        assert self._process is not None and self._process.stdout is not None
        with self._open_log() as log:  # open for the service's life: a line per request
            while line := await self._process.stdout.readline():
                log.write(line)
                log.flush()  # the app shows the log's tail when the service stops

    async def stop(self) -> None:
        """SIGTERM (uvicorn shuts down gracefully and unloads), then SIGKILL if it lingers."""
        process = self._process
        if process is None or process.returncode is not None:
            return
        process.terminate()
        try:
            await asyncio.wait_for(process.wait(), STOP_TIMEOUT_S)
        except TimeoutError:
            process.kill()
            await process.wait()
        if self._stdout_task is not None:
            self._stdout_task.cancel()

    def last_warning(self) -> str | None:
        """The last `warning: ...` line serve wrote (e.g. why it loaded no pair)."""
        warnings = [line for line in self._log_lines() if line.startswith("warning:")]
        return warnings[-1].removeprefix("warning:").strip() if warnings else None

    def log_tail(self) -> str:
        """The log's last few readable lines, short enough for a toast: a traceback's frames
        stay in the log (its last line, the error, says what happened)."""
        try:
            lines = self._log_lines()
        except OSError:
            return "(no service log)"
        said = [line for line in lines if not TRACEBACK_FRAME.match(line)]
        tail = [line if len(line) <= LOG_LINE_CHARS else line[:LOG_LINE_CHARS - 1] + "…"
                for line in said[-LOG_TAIL_LINES:]]
        return "\n".join(tail) or "(the service log is empty)"

    def _log_lines(self) -> list[str]:
        # bytes, decoded here: read_text's universal newlines would make every CR a line
        return readable_lines(self.log_path.read_bytes().decode(errors="replace"))


def readable_lines(log_text: str) -> list[str]:
    """The log's lines as a terminal left them: a line rewritten with CR keeps its last state;
    progress bars, terminal escapes and blank lines go."""
    lines = []
    for line in log_text.split("\n"):
        shown = TERMINAL_ESCAPE.sub("", line.rstrip("\r").rsplit("\r", 1)[-1]).rstrip()
        if shown and not PROGRESS_BAR.search(shown):
            lines.append(shown)
    return lines


async def wait_healthy(client: DFlashClient, timeout: float = HEALTH_TIMEOUT_S,
                       alive=lambda: True) -> dict:
    """GET /health until it answers; a service still starting refuses connections a while."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            return await client.health()
        except ServiceError as exc:
            if not alive():
                raise ServiceStartError("the service exited") from None
            if loop.time() > deadline:
                raise ServiceStartError(f"no answer within {timeout:.0f} s: {exc.message}") from None
            await asyncio.sleep(0.05)
