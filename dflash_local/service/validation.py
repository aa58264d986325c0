"""Request validation errors as one clear sentence that names each bad field and its value.

Pydantic reports a union field once per branch (`block_size.int`, `block_size.literal['auto']`);
those become one message per field ("block_size: Input should be a valid integer, or 'auto'
(got 'fast')"), and the branch a value went furthest into speaks for it.
"""

from __future__ import annotations

import json
import re
from typing import Any

JSON_MEDIA_TYPES = re.compile(r"^application/([\w.+-]+\+)?json$")
FIELD_PART = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
BRANCH_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}  # union branches, not fields
SHOWN_CHARS = 60
MAX_FIELDS_SHOWN = 4
# absolute filesystem paths in a message: callers see only the last component
ABSOLUTE_PATH = re.compile(r"(?<![\w.:/~-])(?:~|/)(?:[^\s'\"/:,()\[\]]+/)+([^\s'\"/:,()\[\]]*)")


def redact_paths(text: str) -> str:
    """The server's directory layout is not the caller's business: keep each path's last part."""
    return ABSOLUTE_PATH.sub(lambda match: f".../{match[1]}", text)


def describe_validation_errors(errors: list[dict], content_type: str | None) -> tuple[str, str | None]:
    """(message, param) for FastAPI's RequestValidationError.errors()."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        where = first.get("loc", ("body", "?"))[-1]
        reason = (first.get("ctx") or {}).get("error", "invalid JSON")
        return f"the request body is not valid JSON: {reason} at character {where}", None
    body_errors = [error for error in errors if _field_path(error.get("loc", ())) == ()]
    media_type = (content_type or "").split(";")[0].strip().lower()
    if body_errors and not JSON_MEDIA_TYPES.match(media_type):
        shown = ascii(content_type) if content_type else "none"
        return f"Content-Type must be application/json, got {shown}", None
    if body_errors and body_errors[0].get("type") == "missing":
        return "the request body is empty: send a JSON object", None
    if body_errors and _is_type_error(body_errors[0]):
        return f"the request body must be a JSON object (got {shown_value(body_errors[0].get('input'))})", None
    groups = _group_by_field(errors)
    messages = [_field_message(path, group) for path, group in groups.items()]
    shown = "; ".join(messages[:MAX_FIELDS_SHOWN])
    if len(messages) > MAX_FIELDS_SHOWN:
        shown += f"; and {len(messages) - MAX_FIELDS_SHOWN} more fields"
    param = ".".join(next(iter(groups))) or None
    return shown, param


def _field_path(loc) -> tuple[str, ...]:
    """The loc without the leading "body" and without union branch tags."""
    parts = list(loc)[1:] if loc and loc[0] == "body" else list(loc)
    return tuple(str(part) for part in parts
                 if isinstance(part, int) or (FIELD_PART.fullmatch(part) and part not in BRANCH_TAGS))


def _group_by_field(errors: list[dict]) -> dict[tuple[str, ...], list[dict]]:
    groups: dict[tuple[str, ...], list[dict]] = {}
    for error in errors:
        groups.setdefault(_field_path(error.get("loc", ())), []).append(error)
    # a union value that got past one branch's type check is judged by that branch alone
    deeper = [path for path in groups
              if any(other != path and other[: len(path)] == path for other in groups)]
    for path in deeper:
        del groups[path]
    return groups


def _is_type_error(error: dict) -> bool:
    return str(error.get("type", "")).endswith("_type") or error.get("type") == "literal_error"


def _field_message(path: tuple[str, ...], group: list[dict]) -> str:
    # a value of the right type that fails a check: that check is the reason, not the other branch
    group = [error for error in group if not _is_type_error(error)] or group
    reasons = list(dict.fromkeys(_reason(error) for error in group))
    text = reasons[0] + "".join(f", or {reason.removeprefix('Input should be ')}"
                                for reason in reasons[1:])
    error = group[0]
    # a count's error names the count: the list itself would add nothing
    if error.get("type") not in ("missing", "too_many") and (
            path or not isinstance(error.get("input"), dict)):
        text += f" (got {shown_value(error.get('input'))})"
    return f"{'.'.join(path)}: {text}" if path else text


def _reason(error: dict) -> str:
    return str(error.get("msg", "invalid value")).removeprefix("Value error, ")


def shown_value(value: Any) -> str:
    """A value as the caller sent it, ASCII-only and short (it may be a 10 MB string)."""
    if isinstance(value, str):
        shown = ascii(value[:SHOWN_CHARS])
        return shown + (f"... ({len(value)} characters)" if len(value) > SHOWN_CHARS else "")
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError):
        text = ascii(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."
