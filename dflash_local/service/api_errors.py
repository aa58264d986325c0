"""Errors as the HTTP API shows them: the service's own error kinds, and every error as
OpenAI-style JSON with the right status, never a traceback (the one error tree is
dflash_local/errors.py).

DFlashError subclasses map to a status by their `code`; validation errors become 400. Every
4xx leaves a line in the log with its reason (ErrorLog), whichever layer refused the request.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dflash_local.errors import DFlashError
from dflash_local.service.validation import describe_validation_errors, redact_paths

log = logging.getLogger("dflash_local.service")


# Agents send the same tools every turn: each distinct note is logged once, up to this many
MAX_LOGGED_NOTES = 256
_logged_notes: set[str] = set()
RETRY_AFTER_S = 1  # a generation on a local pair takes seconds; a client retrying sooner wastes a request


class QueueFullError(DFlashError):
    code = "queue_full"


class NoModelLoadedError(DFlashError):
    code = "model_not_loaded"


class BusyError(DFlashError):
    """A management action that cannot run while a generation or a load is in progress."""

    code = "busy"


class LoadFailedError(DFlashError):
    """A load that broke for a reason of its own (weights unreadable, out of memory)."""

    code = "load_failed"


class NotFoundError(DFlashError):
    code = "not_found"


class AuthenticationError(DFlashError):
    code = "invalid_api_key"


STATUS_BY_CODE = {
    "invalid_request": 400,
    "context_length_exceeded": 400,
    "incompatible_pair": 400,
    "bad_checkpoint": 400,
    "download_refused": 400,
    "model_too_large": 400,
    "invalid_api_key": 401,
    "model_not_found": 404,
    "not_found": 404,
    "busy": 409,
    "queue_full": 429,
    "cancelled": 503,
    "download_cancelled": 409,
    "engine_unavailable": 503,
    "load_failed": 503,
    "model_not_loaded": 503,
    "storage_unavailable": 503,
}
TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


def error_body(status: int, message: str, code: str | None, param: str | None = None) -> dict:
    # a lone surrogate echoed from the request would make the JSON body unencodable
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    param = param.encode("utf-8", "backslashreplace").decode("utf-8") if param else param
    return {"error": {"message": message, "type": TYPE_BY_STATUS.get(status, "server_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, code: str | None, param: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param), status_code=status, headers=headers)


def retry_headers(code: str) -> dict | None:
    """A full queue or a pair still loading is worth retrying: say when."""
    return {"Retry-After": str(RETRY_AFTER_S)} if code in ("queue_full", "model_not_loaded") else None


def status_of(exc: DFlashError) -> int:
    return STATUS_BY_CODE.get(exc.code, 500)


def dflash_error_response(exc: DFlashError) -> JSONResponse:
    status = status_of(exc)
    if status == 500:
        log.error("unmapped %s: %s", type(exc).__name__, exc)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else retry_headers(exc.code)
    # a bad request's message echoes the caller's own values; the others may name server paths
    message = str(exc) if exc.code == "invalid_request" else redact_paths(str(exc))
    return error_response(status, message, exc.code, headers=headers)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(DFlashError)
    async def on_dflash_error(_request: Request, exc: DFlashError) -> JSONResponse:
        return dflash_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_errors(exc.errors(), request.headers.get("content-type"))
        return error_response(400, message, "invalid_request", param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code in (404, 405):  # say which route: "Not Found" alone names nothing
            message += f": {request.method} {request.url.path}"
        code = "invalid_request" if exc.status_code == 400 else None
        return error_response(exc.status_code, message, code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def on_unexpected(_request: Request, exc: Exception) -> JSONResponse:
        return unexpected_error_response(exc)


def unexpected_error_response(exc: Exception) -> JSONResponse:
    """The one catch-all: the client gets a short message, the log gets the traceback."""
    log.exception("unhandled error", exc_info=exc)
    return error_response(500, "internal server error (details are in the server log)",
                          "internal_error")


def log_notes(notes: tuple[str, ...] | list[str], route: str) -> None:
    """Where a request was served otherwise than it asked (a tool left out, a grammar not
    enforced): each distinct note logged once."""
    for note in notes:
        if note not in _logged_notes and len(_logged_notes) < MAX_LOGGED_NOTES:
            _logged_notes.add(note)
            log.warning("%s: %s", route, note)


def logged_reason(body: bytes) -> str:
    """An error body's message, in our shape or Anthropic's ({"error": {"message"}} both)."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode("utf-8", "replace")


class ErrorLog:
    """Pure ASGI: logs every 4xx on one line, its status, route and reason (a guard's, the key's,
    validation's, a route's). The reasons are our own messages: they show a wrong value cut
    short (validation.shown_value), never a whole message's text. Streams pass untouched."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status: list[int] = []
        parts: list[bytes] = []

        async def logging_send(message):
            if message["type"] == "http.response.start" and 400 <= message["status"] < 500:
                status.append(message["status"])
            elif message["type"] == "http.response.body" and status:
                parts.append(message.get("body", b""))
                if not message.get("more_body"):
                    log.warning("%d %s %s: %s", status[0], scope["method"], scope["path"],
                                logged_reason(b"".join(parts)))
            await send(message)

        return await self.app(scope, receive, logging_send)
