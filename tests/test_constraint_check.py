"""check_constraint: every bad constraint is an InvalidRequestError naming the field and the
reason, found without a tokenizer; good ones pass."""

from __future__ import annotations

import json

import pytest

from dflash_local.constraints import grammar
from dflash_local.constraints.check import check_constraint
from dflash_local.errors import InvalidRequestError
from dflash_local.events import OutputConstraint

FIELD = "response_format.json_schema.schema"
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("constraint", [
    OutputConstraint("json_schema", json.dumps(PERSON)),
    OutputConstraint("json_schema", "true"),
    OutputConstraint("json_object", "{}"),
    OutputConstraint("regex", r"\d{3}-\d{4}"),
    OutputConstraint("lark", 'start: "yes" | "no"'),
])
def test_good_constraints_pass(constraint):
    check_constraint(constraint, FIELD)


@pytest.mark.parametrize(("constraint", "reason"), [
    (OutputConstraint("json_schema", "{not json"), "is not JSON"),
    (OutputConstraint("json_schema", "[1, 2]"), "an object or a boolean, got list"),
    (OutputConstraint("json_schema", "false"), "admits no value"),
    (OutputConstraint("json_schema", '{"type": "objekt"}'), "invalid JSON Schema: Invalid type: objekt"),
    (OutputConstraint("json_schema", '{"if": {"type": "string"}, "then": {}}'),
     'unsupported JSON Schema keyword(s): ["if", "then"]'),
    (OutputConstraint("json_schema", '{"$ref": "#/$defs/missing"}'), "/$defs/missing"),
    (OutputConstraint("json_schema", '{"type": "string", "minLength": 5, "maxLength": 2}'),
     "minLength (5) is greater than maxLength (2)"),
    (OutputConstraint("regex", "a(b"), "invalid regex"),
    (OutputConstraint("regex", r"a[^\s\S]"), "the regex cannot match any text"),
    (OutputConstraint("lark", "start: undefined_rule"), "invalid Lark grammar"),
    (OutputConstraint("regex", "a" * (grammar.MAX_SOURCE_CHARS + 1)), "over the limit"),
])
def test_bad_constraints_name_field_and_reason(constraint, reason):
    with pytest.raises(InvalidRequestError) as caught:
        check_constraint(constraint, FIELD)
    assert str(caught.value).startswith(FIELD + ": ")
    assert reason in str(caught.value)


def test_compile_over_the_time_cap_is_refused(monkeypatch):
    monkeypatch.setattr(grammar, "COMPILE_CAP_S", 0.0)
    with pytest.raises(InvalidRequestError, match="to compile, over the cap"):
        check_constraint(OutputConstraint("regex", "[a-z]{1,7}@slow"), FIELD)


def test_grammar_over_the_size_cap_is_refused(monkeypatch):
    monkeypatch.setattr(grammar, "MAX_GRAMMAR_SYMBOLS", 50)
    words = " | ".join(f'"w{index}"' for index in range(200))
    with pytest.raises(InvalidRequestError, match="too complex|limit"):
        check_constraint(OutputConstraint("lark", f"start: {words}"), FIELD)


def test_unknown_kind_is_refused():
    with pytest.raises(InvalidRequestError, match="kind must be one of"):
        OutputConstraint("xml", "<a/>")


def test_the_json_extraction_set_has_a_valid_schema_per_prompt():
    from dflash_local.bench.datasets import load_prompts

    prompts = load_prompts("json-extraction", 100)
    assert len(prompts) >= 10 and len({p.prompt_id for p in prompts}) == len(prompts)
    for prompt in prompts:
        check_constraint(prompt.constraint, prompt.prompt_id)


def test_a_tokenizer_the_grammar_engine_panics_on_is_a_clear_refusal_every_time(monkeypatch):
    """llguidance's Rust panics surface as a BaseException (pyo3's PanicException): caught where
    the tokenizer's twin is built, never let through to kill the thread that asked."""
    from dflash_local.constraints import compile as compile_module

    class PanicException(BaseException):  # pyo3_runtime.PanicException's base, as raised
        pass

    builds = []

    def panicking_twin(_tokenizer):
        builds.append(1)
        raise PanicException("assertion failed: num_parents <= (1 << PARENT_BITS) as usize")

    monkeypatch.setattr(compile_module, "llguidance_tokenizer", panicking_twin)
    compiler = compile_module.ConstraintCompiler(tokenizer=object())
    for _ in range(2):
        with pytest.raises(InvalidRequestError, match="not available for this target's tokenizer"
                                                      ".*num_parents"):
            compiler.grammar(OutputConstraint("regex", "a+"))
    assert builds == [1]  # the refusal is kept, not rebuilt per request
