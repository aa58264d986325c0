"""The constraint a request's reply runs under on the loaded pair, decided at the API edge
before the job is queued: the text constraint the body asked for (output_formats.py), composed
with its strict tools into one grammar on a local engine (tool_grammar.py), or passed to a
served engine's server where that server's structured output takes its kind (engines/table.py).

A constrained reply is held to the grammar from its first token: under a text constraint a
thinking template's switch is turned off (asked on, it is refused: a thought would break the
format); strict tools alone are not enforced while the template may think (a note says so). A
harmony target (gpt-oss) writes channels around its answer: a text constraint is refused.
"""

from __future__ import annotations

from dflash_local.constraints.check import check_constraint
from dflash_local.engines.table import find_engine
from dflash_local.errors import InvalidRequestError
from dflash_local.events import OutputConstraint
from dflash_local.service.api_errors import log_notes
from dflash_local.service.output_formats import AskedConstraint
from dflash_local.service.state import LoadedPair
from dflash_local.service.tool_grammar import compose


def reply_constraint(loaded: LoadedPair, asked: AskedConstraint | None, tools: tuple[dict, ...],
                     tool_choice: str | dict, enforced: dict[str, dict], thinking: bool | None,
                     route: str) -> tuple[OutputConstraint | None, bool | None]:
    """(the reply's constraint, the template's thinking switch). `asked`: the body's text
    constraint; `tools`, `tool_choice`: the JobRequest's; `enforced`: each strict tool's name
    -> the schema its arguments follow."""
    text = asked.constraint if asked is not None else None
    text_field = asked.field if asked is not None else ""
    engine = loaded.engine
    if not engine.capabilities.tokenizes:  # served: its server gets no tools (tool_calls.plan_tools)
        kinds = _served_kinds(engine.pair.engine)
        if text is not None and text.kind not in kinds:
            raise InvalidRequestError(
                f"{text_field}: the {engine.pair.engine} server takes {', '.join(kinds) or 'no'} "
                f"constraints, not {text.kind}")
        return text, reply_thinking(thinking, text)
    support = loaded.worker.tool_support
    if support.harmony and text is not None:
        raise InvalidRequestError(f"{text_field}: {support.model} writes harmony channels around "
                                  f"its answer, which a constrained reply cannot hold")
    notes = []
    if text is None and enforced and thinking is not False and _thinks(engine):
        notes.append(f"strict tools: not enforced while {support.model} may think first (its "
                     f"template's thinking is on); turn thinking off to enforce them")
        enforced = {}
    grammar = compose(support, tools, tool_choice, enforced, text)
    log_notes((*notes, *grammar.notes), route)
    if grammar.constraint is not None and grammar.constraint is not text:
        # composed of checked parts; checked whole before it queues (cached by value)
        check_constraint(grammar.constraint, f"tools (with {text_field})" if text else "tools")
    return grammar.constraint, reply_thinking(thinking, text)


def _thinks(engine) -> bool:
    """Whether the target's template has a thinking switch (Qwen3's `enable_thinking`)."""
    return "enable_thinking" in (getattr(engine.tokenizer, "chat_template", None) or "")


def _served_kinds(engine_name: str) -> tuple[str, ...]:
    spec = find_engine(engine_name)
    return spec.constraint_kinds if spec is not None else ()


def reply_thinking(thinking: bool | None, text: OutputConstraint | None) -> bool | None:
    """The template's thinking switch: off under a text constraint unless asked, and then
    refused (the answer is held to the grammar from its first token; a thought would break it)."""
    if text is None:
        return thinking
    if thinking:
        raise InvalidRequestError("thinking cannot go with a constrained reply (the grammar holds "
                                  "it from its first token): turn thinking off")
    return False
