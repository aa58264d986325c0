"""Server-sent events as every stream here frames them: `data:` lines (chat completions and the
download progress, which end in `[DONE]`) or events named by their payload's `type` (Anthropic
Messages and the Responses API), and the headers that keep a proxy from buffering them.
"""

from __future__ import annotations

import json

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# sent after KEEPALIVE_S without an event (a long prefill): clients and proxies that time out an
# idle connection keep waiting. A comment line, which every SSE parser skips (Anthropic's stream
# sends its own `ping` event instead)
KEEPALIVE_S = 5.0


def keepalive_comment(progress: str = "") -> bytes:
    """`: keep-alive`, with the prefill's progress where there is one (`prefill 30000 tokens, 12 s`)."""
    return f": keep-alive {progress}\n\n".encode() if progress else b": keep-alive\n\n"


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def named_sse(payload: dict) -> bytes:
    """An event named by its payload's `type` (Anthropic's and the Responses API's streams)."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()
