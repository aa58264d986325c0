"""An OutputConstraint as an llguidance grammar, and the limits every compile runs under.
The one place that knows llguidance's grammar formats; check.py and compile.py build on it."""

from __future__ import annotations

import json

from dflash_local.errors import InvalidRequestError
from dflash_local.events import OutputConstraint

MAX_SOURCE_CHARS = 200_000  # a schema, regex or grammar longer than this is refused unread
COMPILE_CAP_S = 2.0  # a compile past this is refused: the request would stall the worker
MAX_GRAMMAR_SYMBOLS = 200_000  # llguidance's own size bound on a compiled grammar
# JSON's whitespace is fixed (", " and ": ", nothing else), so a schema's punctuation and
# keys are forced tokens: a free draft, and one spelling for greedy equality to hold.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def parser_limits():
    """Bounds on a grammar's size and on the lexer's work per compile and per token."""
    import llguidance

    return llguidance.LLParserLimits(max_grammar_size=MAX_GRAMMAR_SYMBOLS, max_lexer_states=50_000,
                                     initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                                     verbose_errors=False)


def grammar_text(constraint: OutputConstraint, field: str) -> str:
    """The llguidance grammar for `constraint`; `field` names it in an error (a request path)."""
    import llguidance

    if len(constraint.source) > MAX_SOURCE_CHARS:
        raise InvalidRequestError(f"{field}: {len(constraint.source)} characters is over the "
                                  f"limit of {MAX_SOURCE_CHARS}")
    if constraint.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(constraint.source)
    if constraint.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(constraint.source)
    schema = _schema_object(constraint, field)
    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)


def _schema_object(constraint: OutputConstraint, field: str) -> dict | bool:
    """The schema as JSON: an object or a boolean schema; json_object is any object."""
    if constraint.kind == "json_object":
        return {"type": "object"}
    try:
        schema = json.loads(constraint.source)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"{field}: the JSON Schema is not JSON: {exc}") from None
    if not isinstance(schema, dict | bool):
        raise InvalidRequestError(f"{field}: a JSON Schema is an object or a boolean, "
                                  f"got {type(schema).__name__}")
    if schema is True:
        return {}
    if schema is False:
        raise InvalidRequestError(f"{field}: the schema `false` admits no value")
    return schema
