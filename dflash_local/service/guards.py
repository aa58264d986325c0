"""What every request passes before a route sees it: the Host allow-list and the API key (every
route but /health needs it, when the service has one). The body's checks: request_body.py.

Pure ASGI, so streamed responses are never buffered. The Host check stops DNS rebinding: a web
page on evil.example that resolves its name to 127.0.0.1 still sends `Host: evil.example`.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from dflash_local.service.api_errors import error_response
from dflash_local.service.validation import shown_value

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
OPEN_PATHS = ("/health",)  # answered without the key


def host_name(header: str) -> str:
    """`Host` without its port: "[::1]:8000" -> "::1", "Example.com:80" -> "example.com"."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


class HostAllowList:
    """Answers 400 to a Host header not in the list ("*" in it allows any)."""

    def __init__(self, app, allowed_hosts: Iterable[str] = LOOPBACK_HOSTS):
        self.app = app
        self.allowed = {host_name(host) for host in allowed_hosts}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or "*" in self.allowed:
            return await self.app(scope, receive, send)
        header = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
        if host_name(header) not in self.allowed:
            response = error_response(
                400, f"Host header {shown_value(header)} is not allowed (this server answers to "
                     f"{', '.join(sorted(self.allowed))}; serve with --allow-host to add one)",
                "host_not_allowed", "Host")
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


class BearerAuth:
    """Pure ASGI (no buffering of streams): checked before the body is even read. The key comes
    as `Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY` (Anthropic's)."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if self.api_key is None or scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if not hmac.compare_digest(presented_key(dict(scope["headers"])), self.api_key):
            response = error_response(
                401, "missing or invalid API key (Authorization: Bearer ..., or x-api-key)",
                "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def presented_key(headers: dict[bytes, bytes]) -> bytes:
    scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
    if scheme.lower() == b"bearer":
        return token.strip()
    return b"" if b"authorization" in headers else headers.get(b"x-api-key", b"").strip()
