"""What every request's body passes before a route sees it, read once: its size (declared or
streamed, 413 past the limit), its arrival (408 when it trickles in slower than the deadline),
and for a JSON body, UTF-8 and its nesting depth (json_depth.py; 400).

Pure ASGI: the body is read whole (it is bounded), checked, and replayed to the route, so the
route's parser never sees bytes that did not pass. A slow client's headers and idle connections
are the server's to time out (server.py); the body, once the route is known, is timed out here,
so the 408 leaves in the route's API shape.
"""

from __future__ import annotations

import asyncio

from dflash_local.service.api_errors import error_response
from dflash_local.service.json_depth import body_problem
from dflash_local.service.validation import shown_value

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # far past any prompt a local context holds
BODY_TIMEOUT_S = 30.0  # 4 MB arrives in well under a second on any link a local service faces
SCAN_IN_THREAD_BYTES = 64 * 1024  # a larger body is scanned off the event loop
BODY_METHODS = ("POST", "PUT", "PATCH")  # the methods whose bodies the routes read


class BodyRefused(Exception):
    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class RequestBody:
    """Answers 400 to a Content-Length that is not a number, 413 to a body over `max_bytes`,
    408 to one not in within `timeout_s`, and 400 to a JSON body that is not UTF-8 or nests
    too deep; hands the same bytes on to the route."""

    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 timeout_s: float = BODY_TIMEOUT_S):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            self._check_declared(dict(scope["headers"]).get(b"content-length"))
            if scope["method"] not in BODY_METHODS:
                return await self.app(scope, receive, send)
            body = await self._read(receive)
            if body is None:
                return None  # the client left
            problem = (await asyncio.to_thread(body_problem, body)
                       if len(body) > SCAN_IN_THREAD_BYTES else body_problem(body))
            if problem is not None:
                raise BodyRefused(400, problem, "invalid_request")
        except BodyRefused as refused:
            response = error_response(refused.status, refused.message, refused.code)
            return await response(scope, receive, send)
        return await self.app(scope, replay(body, receive), send)

    def _too_large(self, size: str) -> BodyRefused:
        return BodyRefused(413, f"request body of {size} is over this server's limit of "
                                f"{self.max_bytes} bytes (serve --max-body-bytes)",
                           "request_too_large")

    def _check_declared(self, declared: bytes | None) -> None:
        if declared is None:
            return
        text = declared.decode("latin-1")
        if not text.isdigit():
            raise BodyRefused(400, f"Content-Length {shown_value(text)} is not a number of bytes",
                              "invalid_request")
        if int(text) > self.max_bytes:
            raise self._too_large(f"{text} bytes")

    async def _read(self, receive) -> bytes | None:
        chunks, received = [], 0
        try:
            async with asyncio.timeout(self.timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunks.append(message.get("body", b""))
                    received += len(chunks[-1])
                    if received > self.max_bytes:  # a chunked body that declared no length
                        raise self._too_large(f"over {self.max_bytes} bytes")
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            raise BodyRefused(408, f"request body not received within {self.timeout_s:g} s "
                                   f"({received} bytes arrived)", "request_timeout") from None


def replay(body: bytes, receive):
    """A `receive` that hands the route the body already read, then waits for the disconnect."""
    delivered = False

    async def replayed():
        nonlocal delivered
        if delivered:
            return await receive()
        delivered = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed
