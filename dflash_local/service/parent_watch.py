"""The service ends soon after the app that started it is gone (killed, crashed), not minutes
later: dflash-chat names itself in DFLASH_LOCAL_PARENT_PID, and a daemon thread here watches
for the service being handed to another parent (what the kernel does when the parent dies).

Boundary: stdlib only; the serve command starts it, and what stops the service is SIGTERM to
this process (uvicorn shuts down and unloads; before it runs, the default handler ends it).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

logger = logging.getLogger("dflash_local.service")
PARENT_PID_ENV = "DFLASH_LOCAL_PARENT_PID"
WATCH_EVERY_S = 0.5
SHUTDOWN_GRACE_S = 10.0  # after SIGTERM, how long a graceful shutdown may take


def watch_parent_from_env() -> threading.Thread | None:
    """Start watching the parent that PARENT_PID_ENV names (nothing when it is unset)."""
    named = os.environ.pop(PARENT_PID_ENV, None)  # not for the service's own children
    if not named:
        return None
    try:
        parent_pid = int(named)
    except ValueError:
        logger.warning("%s=%r is not a process id: the service does not watch its parent",
                       PARENT_PID_ENV, named)
        return None
    watcher = threading.Thread(target=_watch, args=(parent_pid,), name="parent-watch",
                               daemon=True)
    watcher.start()
    return watcher


def _watch(parent_pid: int) -> None:
    # a dead parent's child is handed to init (or a subreaper): its parent pid changes; started
    # through a wrapper (`sh -c`, `uv run`), the app is not our parent: watch it live instead
    alive = _still_parent if os.getppid() == parent_pid else _still_running
    while alive(parent_pid):
        time.sleep(WATCH_EVERY_S)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(SHUTDOWN_GRACE_S)
    os._exit(1)  # a shutdown stuck on something: nobody is left to wait for it


def _still_parent(pid: int) -> bool:
    return os.getppid() == pid


def _still_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True
