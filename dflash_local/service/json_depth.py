"""What every JSON body passes before anything parses it: valid UTF-8, and nesting no deeper than
MAX_JSON_DEPTH, on every route of every API.

Free-form JSON (tool schemas, tool inputs, a call's `arguments`) is walked recursively by the
JSON parser, pydantic, the text marking and the chat template; nested some hundreds deep it
exhausts Python's stack. The depth is scanned without recursion (strings skipped, brackets
counted), on the raw body here and on a call's `arguments` text where it is validated
(request_fields.py); request_body.py runs the body checks before any route.
"""

from __future__ import annotations

import numpy as np

MAX_JSON_DEPTH = 100  # far past any real tool schema; far below what exhausts the stack
NOT_BRACKETS = bytes(set(range(256)) - set(b"[]{}"))


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
