"""What every JSON body passes before anything parses it: valid UTF-8, and nesting no deeper than
MAX_JSON_DEPTH, on every route of every API.

Free-form JSON (tool schemas, tool inputs, a call's `arguments`) is walked recursively by the
JSON parser, pydantic, the text marking and the chat template; nested some hundreds deep it
exhausts Python's stack. The depth is scanned without recursion (strings skipped, brackets
counted), on the raw body here and on a call's `arguments` text where it is validated
(request_fields.py). Pure ASGI; the body is already bounded by guards.BodyLimit.
"""

from __future__ import annotations

import asyncio

import numpy as np
from fastapi import HTTPException

from dflash_local.service.api_errors import error_response

MAX_JSON_DEPTH = 100  # far past any real tool schema; far below what exhausts the stack
NOT_BRACKETS = bytes(set(range(256)) - set(b"[]{}"))
SCAN_IN_THREAD_BYTES = 64 * 1024  # a larger body is scanned off the event loop


def json_depth(text: bytes | str) -> int:
    """The deepest nesting of JSON `text` (0 for a scalar), counted without recursion: escapes
    dropped (pairs from the left, as JSON reads them), then what lies between quotes, then all
    but brackets. Text that is not JSON gets a number too; its parser says what is wrong."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    unescaped = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = b"".join(unescaped.split(b'"')[::2]).translate(None, NOT_BRACKETS)
    if not brackets:
        return 0
    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = ((codes == ord("[")) | (codes == ord("{"))).astype(np.int64) * 2 - 1  # open +1, close -1
    return int(np.cumsum(steps).max())


def depth_problem(text: bytes | str, where: str) -> str | None:
    depth = json_depth(text)
    if depth <= MAX_JSON_DEPTH:
        return None
    return (f"{where} nests JSON {depth} levels deep: at most {MAX_JSON_DEPTH} levels are "
            f"accepted")


def utf8_problem(body: bytes) -> str | None:
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return (f"request body is not valid UTF-8 (byte {exc.start}: "
                f"{body[exc.start:exc.start + 1]!r}): JSON bodies are UTF-8 text")
    return None


def body_problem(body: bytes) -> str | None:
    return utf8_problem(body) or depth_problem(body, "request body")


class JsonBodyCheck:
    """Reads a request's body once (BodyLimit bounds it), answers 400 to one that is not UTF-8
    or nests too deep, and hands the same bytes on to the route."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        try:
            chunks, more = [], True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                chunks.append(message.get("body", b""))
                more = message.get("more_body", False)
        except HTTPException as exc:  # BodyLimit's 413, raised from its receive
            return await error_response(exc.status_code, str(exc.detail),
                                        "request_too_large")(scope, receive, send)
        body = b"".join(chunks)
        if len(body) > SCAN_IN_THREAD_BYTES:
            problem = await asyncio.to_thread(body_problem, body)
        else:
            problem = body_problem(body)
        if problem is not None:
            return await error_response(400, problem, "invalid_request")(scope, receive, send)
        delivered = False

        async def replay():
            nonlocal delivered
            if delivered:
                return await receive()  # a disconnect, once the route waits for one
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)
