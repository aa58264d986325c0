"""The service ends soon after the app that started it is gone (killed, crashed), not minutes
later: dflash-chat names itself in DFLASH_LOCAL_PARENT_PID, and a daemon thread here watches
for the service being handed to another parent (what the kernel does when the parent dies).

Boundary: stdlib only; the serve command starts it, and what stops the service is SIGTERM to
this process (uvicorn shuts down and unloads; before it runs, the default handler ends it).
"""

from __future__ import annotations

import os
import signal
import threading
import time

PARENT_PID_ENV = "DFLASH_LOCAL_PARENT_PID"
WATCH_EVERY_S = 0.5
SHUTDOWN_GRACE_S = 10.0  # after SIGTERM, how long a graceful shutdown may take


def watch_parent_from_env() -> threading.Thread | None:
    """Start watching the parent that PARENT_PID_ENV names (nothing when it is unset)."""
    named = os.environ.pop(PARENT_PID_ENV, None)  # not for the service's own children
    if not named:
        return None
    parent_pid = int(named)
    watcher = threading.Thread(target=_watch, args=(parent_pid,), name="parent-watch",
                               daemon=True)
    watcher.start()
    return watcher


def _watch(parent_pid: int) -> None:
    # a dead parent's child is handed to init (or a subreaper): its parent pid changes
    while os.getppid() == parent_pid:
        time.sleep(WATCH_EVERY_S)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(SHUTDOWN_GRACE_S)
    os._exit(1)  # a shutdown stuck on something: nobody is left to wait for it
