"""Running the app under uvicorn: on a socket we bind ourselves (port 0 = a free port, known
before the first request), in the foreground (the CLI) or on a thread (tests, benchmarks).

Slow clients are timed out at the connection: a request's headers must arrive within
HEADERS_TIMEOUT_S of the connection or of the previous reply, so an idle connection, new or kept
alive, closes then too. A reply being streamed is never cut: the deadline only watches the
client's side until its request is in. The body's own deadline is request_body.py's.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import threading
import time
from typing import Self

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

READY_TIMEOUT_S = 30.0
HEADERS_TIMEOUT_S = 10.0  # a request line and headers are a few hundred bytes
REQUEST_TIMEOUT_REPLY = (b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n"
                         b"Connection: close\r\n\r\n")


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)  # connections made before uvicorn starts wait in the backlog, not refused
    return sock


class HeadersDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose next request's headers are not in
    `headers_timeout_s` after it opened or after its last reply (408 when some bytes came), and
    one still sending a body its reply no longer reads."""

    def __init__(self, *args, headers_timeout_s: float = HEADERS_TIMEOUT_S, **kwargs):
        super().__init__(*args, **kwargs)
        self.headers_timeout_s = headers_timeout_s
        self.headers_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_headers_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_headers_deadline()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        self._arm_headers_deadline()  # before the next pipelined request may start
        super().on_response_complete()

    def _arm_headers_deadline(self) -> None:
        self._disarm_headers_deadline()
        self.headers_deadline = self.loop.call_later(self.headers_timeout_s, self._headers_overdue)

    def _disarm_headers_deadline(self) -> None:
        if self.headers_deadline is not None:
            self.headers_deadline.cancel()
            self.headers_deadline = None

    def _headers_overdue(self) -> None:
        replying = self.cycle is not None and not self.cycle.response_complete
        if self.transport.is_closing() or replying:
            return  # a request in, its reply (streamed or not) under way: not a slow client
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            self.transport.write(REQUEST_TIMEOUT_REPLY)  # headers begun, never finished
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):
            self.transport.close()


def make_server(app, log_level: str = "warning",
                headers_timeout_s: float = HEADERS_TIMEOUT_S) -> uvicorn.Server:
    protocol = functools.partial(HeadersDeadlineProtocol, headers_timeout_s=headers_timeout_s)
    config = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5,
                            access_log=log_level in ("debug", "info"), http=protocol,
                            timeout_keep_alive=headers_timeout_s)  # uvicorn's timer, the same rule
    return uvicorn.Server(config)


class BackgroundServer:
    """The app served on a thread; `url` is valid once `start()` returns."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 headers_timeout_s: float = HEADERS_TIMEOUT_S):
        self._socket = bind(host, port)
        self.port = self._socket.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = make_server(app, log_level, headers_timeout_s)
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
