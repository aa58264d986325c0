"""Running the app under uvicorn: on a socket we bind ourselves (port 0 = a free port, known
before the first request), in the foreground (the CLI) or on a thread (tests, benchmarks)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Self

import uvicorn

READY_TIMEOUT_S = 30.0


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)  # connections made before uvicorn starts wait in the backlog, not refused
    return sock


def make_server(app, log_level: str = "warning") -> uvicorn.Server:
    config = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5,
                            access_log=log_level in ("debug", "info"))
    return uvicorn.Server(config)


class BackgroundServer:
    """The app served on a thread; `url` is valid once `start()` returns."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self._socket = bind(host, port)
        self.port = self._socket.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = make_server(app, log_level)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._socket]},
                                        name="uvicorn", daemon=True)

    def start(self) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(READY_TIMEOUT_S)
        self._socket.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
