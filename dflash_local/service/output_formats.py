"""What each API asks a reply's text to follow, as one OutputConstraint (events.py).

OpenAI chat `response_format`, Responses `text.format`, Anthropic `output_config.format` (and its
beta name `output_format`), and our `structured_outputs` extension (vLLM's field name: a regex
or a Lark grammar in llguidance's dialect). Each schema or grammar is checked
(constraints.check_constraint) while the body is validated, so a bad one is a 400 naming its
field, the place inside it and the reason, before anything is queued. `strict` is accepted
either way: a schema given is always enforced.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Discriminator, Field, Tag, model_validator

from dflash_local.constraints.check import check_constraint
from dflash_local.errors import InvalidRequestError
from dflash_local.events import OutputConstraint
from dflash_local.service.request_fields import DFlashOptions, StrictModel, Text

HERE = "<field>"  # check_constraint's name for the field, replaced by pydantic's path
JSON_OBJECT = OutputConstraint("json_object", "{}")
FORMAT_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for a response format's name


def checked(kind: str, source: str) -> OutputConstraint:
    """The constraint, compiled once to prove it; a ValueError (pydantic words it at the field)
    names the place inside it and the reason."""
    constraint = OutputConstraint(kind, source)
    try:
        check_constraint(constraint, HERE)
    except InvalidRequestError as exc:  # pydantic's error names the field: say the rest
        raise ValueError(str(exc).removeprefix(f"{HERE}: ")) from None
    return constraint


def _checked_schema(schema: dict) -> dict:
    checked("json_schema", json.dumps(schema))
    return schema


# a JSON Schema a reply (or a strict tool's arguments) must follow, checked where it is given
JsonSchema = Annotated[dict[str, Any], AfterValidator(_checked_schema)]


def schema_constraint(schema: dict | None) -> OutputConstraint:
    """A checked schema's constraint; no schema: any JSON object."""
    return JSON_OBJECT if schema is None else OutputConstraint("json_schema", json.dumps(schema))


class TextFormat(StrictModel):
    type: Literal["text"]

    def constraint(self) -> None:
        return None


class JsonObjectFormat(StrictModel):
    type: Literal["json_object"]

    def constraint(self) -> OutputConstraint:
        return JSON_OBJECT


class NamedSchema(StrictModel):
    """A named schema: chat's `response_format.json_schema`, Responses' `text.format` itself."""

    name: str = Field(pattern=FORMAT_NAME)
    description: Text | None = None
    schema_: JsonSchema | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is enforced either way

    def constraint(self) -> OutputConstraint:
        return schema_constraint(self.schema_)


class ChatJsonSchemaFormat(StrictModel):
    type: Literal["json_schema"]
    json_schema: NamedSchema

    def constraint(self) -> OutputConstraint:
        return self.json_schema.constraint()


class ResponsesJsonSchemaFormat(NamedSchema):
    type: Literal["json_schema"]
    schema_: JsonSchema = Field(alias="schema")  # required here, as OpenAI's Responses has it


def _format_kind(value: Any) -> str | None:
    """Tags that are no field name stay out of error paths (validation.py)."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"<{kind}>" if kind in ("text", "json_object", "json_schema") else None


ChatResponseFormat = Annotated[
    Annotated[TextFormat, Tag("<text>")] | Annotated[JsonObjectFormat, Tag("<json_object>")]
    | Annotated[ChatJsonSchemaFormat, Tag("<json_schema>")], Discriminator(_format_kind)]
ResponsesTextFormat = Annotated[
    Annotated[TextFormat, Tag("<text>")] | Annotated[JsonObjectFormat, Tag("<json_object>")]
    | Annotated[ResponsesJsonSchemaFormat, Tag("<json_schema>")], Discriminator(_format_kind)]


class ResponsesText(StrictModel):
    """Responses' `text`: its `format` (verbosity has no meaning for a local target)."""

    format: ResponsesTextFormat | None = None


class AnthropicJsonFormat(StrictModel):
    type: Literal["json_schema"]
    schema_: JsonSchema = Field(alias="schema")

    def constraint(self) -> OutputConstraint:
        return schema_constraint(self.schema_)


class AnthropicOutputConfig(StrictModel):
    """Anthropic's `output_config` (its `effort` has no meaning for a local target)."""

    format: AnthropicJsonFormat | None = None


def _checked_regex(regex: str) -> str:
    checked("regex", regex)
    return regex


def _checked_lark(grammar: str) -> str:
    checked("lark", grammar)
    return grammar


class StructuredOutputs(StrictModel):
    """Our extension, named as vLLM names its own: exactly one of a regex the whole reply
    matches, or a Lark grammar (llguidance's dialect: `%json {...}` embeds a schema)."""

    regex: Annotated[Text, AfterValidator(_checked_regex)] | None = None
    grammar: Annotated[Text, AfterValidator(_checked_lark)] | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        if (self.regex is None) == (self.grammar is None):
            raise ValueError('give exactly one of "regex" and "grammar" (a Lark grammar)')
        return self

    def constraint(self) -> OutputConstraint:
        if self.regex is not None:
            return OutputConstraint("regex", self.regex)
        return OutputConstraint("lark", self.grammar)


class ConstrainableOptions(DFlashOptions):
    """Our extensions on a generating endpoint, `structured_outputs` among them."""

    structured_outputs: StructuredOutputs | None = None


def strict_schema(schema: dict | None) -> dict:
    """A strict function tool's parameters, checked (a ValueError names the place and reason)."""
    schema = schema or {"type": "object", "properties": {}}
    _checked_schema(schema)
    return schema


def check_strict_tool(schema: dict | None, field: str) -> None:
    """A strict tool's schema compiles: a ValueError naming `field`, the place and the reason."""
    try:
        strict_schema(schema)
    except ValueError as exc:
        raise ValueError(f"{field} (strict): {exc}") from None


@dataclass(frozen=True)
class AskedConstraint:
    """The text constraint a body asked for, and the field that asked (for errors)."""

    field: str
    constraint: OutputConstraint


def one_constraint(**given: OutputConstraint | None) -> AskedConstraint | None:
    """The one constraint among a body's fields that may ask for one; two is a 400."""
    named = [AskedConstraint(field, constraint) for field, constraint in given.items()
             if constraint is not None]
    if len(named) > 1:
        raise InvalidRequestError(f"{' and '.join(asked.field for asked in named)} both "
                                  f"constrain the reply: give one")
    return named[0] if named else None
