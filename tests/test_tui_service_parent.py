"""The service dflash-chat starts ends soon after the app is killed (issue 51: it outlived a
killed app for minutes). A real parent starts the real service as the app does (ServiceProcess,
`serve --no-load`), is killed with SIGKILL, and the service must be gone within seconds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

STARTED_WITHIN_S = 120.0  # serve imports FastAPI on a shared machine
GONE_WITHIN_S = 15.0
PARENT = """
import asyncio, sys
from pathlib import Path
from dflash_chat.service import ServiceProcess

async def main():
    process = ServiceProcess(["--no-load"], Path(sys.argv[1]))
    await process.start()
    Path(sys.argv[2]).write_text(str(process.pid))
    await asyncio.Event().wait()  # the app, running until it is killed

asyncio.run(main())
"""


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_for(predicate, within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not within {within_s:.0f} s"
        time.sleep(0.1)


def test_the_service_ends_soon_after_its_app_is_killed(tmp_path):
    pid_file = tmp_path / "service.pid"
    app = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path / "serve.log"),
                            str(pid_file)], env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                [str(Path("tui").resolve()), os.environ.get("PYTHONPATH", "")])})
    service_pid = None
    try:
        wait_for(lambda: pid_file.exists() or app.poll() is not None, STARTED_WITHIN_S,
                 "the service serving")
        assert app.poll() is None, (tmp_path / "serve.log").read_text()
        service_pid = int(pid_file.read_text())
        app.send_signal(signal.SIGKILL)
        app.wait()
        wait_for(lambda: not running(service_pid), GONE_WITHIN_S, "the orphaned service ending")
    finally:
        if app.poll() is None:
            app.kill()
        if service_pid is not None and running(service_pid):
            os.kill(service_pid, signal.SIGKILL)
