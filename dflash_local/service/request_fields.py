"""What every API's request body shares: the strict base model, valid text, the caps on a
request's counts, our `dflash` extensions, OpenAI's function-call form, and the chat-template
form every API's tools and calls end up in (so one conversation renders the same prompt whichever
API it came through).

Strict types (no "5" for 5, no true for 1); numbers are finite; text is valid Unicode. Replies
are plain dicts each API's module builds: they are ours to shape, and dicts stream fastest.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from dflash_local.engines.chat_prompt import unicode_problem
from dflash_local.service.json_depth import depth_problem
from dflash_local.service.validation import shown_value

MAX_TOKENS_LIMIT = 1_000_000  # beyond any context we serve; the context check comes later
MAX_STOP_STRINGS = 8
# A request's counts, far past what a real conversation sends (a long agent session has hundreds
# to a few thousand messages, an agent with many MCP servers a few hundred tools), yet refused
# before one item is validated: 10^6 empty messages would hold the worker in the template.
MAX_MESSAGES = 10_000
MAX_TOOLS = 1_000
MAX_STOP_CHARS = 1_000  # a stop string longer than any reply we would write cannot match
# a fixed width, or "auto": the calibrated policy picks each round's width (1 = plain fallback)
BlockSize = Annotated[int, Field(ge=1, le=256)] | Literal["auto"]


def check_unicode(value: str) -> str:
    if (problem := unicode_problem(value)) is not None:
        raise ValueError(problem)
    return value


Text = Annotated[str, AfterValidator(check_unicode)]


def joined_text(content: str | list | None) -> str | None:
    """A content given as a string or as text parts (each with `.text`), as one string."""
    if content is None or isinstance(content, str):
        return content
    return "".join(part.text for part in content)


def check_count(values: list, limit: int, what: str) -> None:
    """A list's count within its cap; the error (type "too_many") names the count and the cap."""
    if len(values) > limit:
        raise PydanticCustomError("too_many", "at most {limit} {what}, got {count}",
                                  {"limit": limit, "what": what, "count": len(values)})


def at_most(limit: int, what: str) -> BeforeValidator:
    """A list field's cap, checked before its items are validated."""
    def check(value: Any) -> Any:
        if isinstance(value, list):
            check_count(value, limit, what)
        return value

    return BeforeValidator(check)


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


# --- OpenAI's function call: chat's tool_calls[].function, and a Responses function_call item ---

TOOL_NAME_PATTERN = r"[A-Za-z0-9_.-]{1,64}"  # OpenAI's rule for a function's name
ToolName = Annotated[str, Field(pattern=f"^{TOOL_NAME_PATTERN}$")]


class FunctionCall(StrictModel):
    name: ToolName
    arguments: Text  # an object's JSON text, as OpenAI sends it

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str) -> str:
        if (problem := depth_problem(arguments, "the text")) is not None:
            raise ValueError(problem)  # before the parser recurses into it
        try:
            value = json.loads(arguments)
        except ValueError as exc:
            raise ValueError(f"must be an object's JSON text: {exc}") from None
        if not isinstance(value, dict):
            # pydantic words a ValueError as this field's error (a TypeError would escape it)
            raise ValueError(f"must be an object's JSON text, got a {type(value).__name__}")  # noqa: TRY004
        return arguments


def check_object_schema(schema: dict) -> dict:
    """A tool's parameters: a JSON Schema of type object (chat templates render a call's
    arguments as an object's properties)."""
    if schema.get("type") != "object":
        shown_type = json.dumps(schema.get("type"), ensure_ascii=True)[:SHOWN_TYPE_CHARS]
        raise ValueError(f'must be a JSON Schema of type "object", got type {shown_type}')
    return schema


SHOWN_TYPE_CHARS = 60
ObjectSchema = Annotated[dict[str, Any], AfterValidator(check_object_schema)]


def template_tool(name: str, description: str | None, parameters: dict | None) -> dict:
    """A function tool as chat templates take it; every endpoint's tools end up in this form,
    so one conversation renders the same prompt whichever API it came through."""
    return {"type": "function", "function": {
        "name": name, "description": description or "",
        "parameters": parameters or {"type": "object", "properties": {}}}}


def template_call(call_id: str, name: str, arguments: dict) -> dict:
    """An earlier reply's call as chat templates take it (arguments a dict), whichever API sent it."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def check_answers_a_call(call_id: str, called: set[str], where: str, calls: str) -> None:
    """A tool result answers a call made earlier in the conversation, by its id: one rule and
    one wording on every API (`calls` is what the API calls a call)."""
    if call_id not in called:
        earlier = ", ".join(shown_value(known) for known in sorted(called)[:5]) or "none"
        raise ValueError(f"{where}: {shown_value(call_id)} answers no {calls} of an earlier "
                         f"assistant turn (ids called before it: {earlier})")


class DFlashOptions(StrictModel):
    """Our extensions, the same on every generating endpoint (chat, messages, responses), with
    output_formats.ConstrainableOptions' `structured_outputs`."""

    speculative: bool | None = None
    block_size: BlockSize | None = None
    prompt_lookup: bool | None = None  # with block_size "auto": may verify prompt-lookup drafts
    tree: bool | None = None  # verify a tree of drafts per round (default on)
    draft_window: int | None = Field(None, ge=1)  # context rows the drafter keeps (local engines)


def check_stop_strings(stops: list[str]) -> None:
    check_count(stops, MAX_STOP_STRINGS, "stop strings per request")
    for index, text in enumerate(stops):
        if not 1 <= len(text) <= MAX_STOP_CHARS:
            raise ValueError(f"stop string {index} has {len(text)} characters: each must have "
                             f"1 to {MAX_STOP_CHARS}")

