"""A request's tools on the worker's path: what the prompt gets, and the splitter for the reply.

Every API edge (chat completions, messages, responses) hands the worker OpenAI function tools
and a tool_choice; here they become the template's `tools`, a forced call's opener at the end
of the prompt (tool_choice "required" or a named function), and a ToolCallSplitter that takes
the call markup out of the reply. Whether the target can take tools, and in which format it
writes calls, is read from its chat template once, at load (ToolSupport).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

from dflash_local.engines.detokenize import speaks_harmony
from dflash_local.errors import InvalidRequestError
from dflash_local.service.harmony import HarmonySplitter
from dflash_local.service.job_items import ToolCallDelta
from dflash_local.service.tool_formats import ToolFormat, format_for_template, template_uses_tools
from dflash_local.service.tool_stream import ToolCallSplitter
from dflash_local.service.validation import redact_paths


@dataclass(frozen=True)
class ToolSupport:
    """What a loaded engine can do with tools, judged once at load."""

    model: str  # the target's name (a path's last part), for errors
    local: bool  # False: a served engine, whose server gets no tools from us
    uses_tools: bool  # its chat template renders `tools`
    format: ToolFormat | None  # the format it writes calls in; None: one we do not parse
    # a local harmony target (gpt-oss): its text keeps harmony's markers, every reply is split
    # into content, reasoning and calls (service/harmony.py)
    harmony: bool = False

    @classmethod
    def of(cls, engine) -> ToolSupport:
        tokenizer = getattr(engine, "tokenizer", None)
        template = getattr(tokenizer, "chat_template", None)
        local = engine.capabilities.tokenizes
        harmony = local and tokenizer is not None and speaks_harmony(tokenizer)
        model_type = "gpt_oss" if harmony else _model_type(engine.pair.target_path)
        return cls(model=redact_paths(engine.pair.target), local=local,
                   uses_tools=template_uses_tools(template),
                   format=format_for_template(template, model_type), harmony=harmony)


def _model_type(target_path: Path | None) -> str | None:
    try:
        return json.loads((target_path / "config.json").read_text()).get("model_type")
    except (TypeError, OSError, ValueError, AttributeError):
        return None


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict] | None  # for the chat template; None: render without tools
    assistant_prefix: str | tuple[str, ...]  # the reply's forced start ("" unless a call is forced)
    splitter: ToolCallSplitter | HarmonySplitter | None  # None: the reply is all text


NO_TOOLS = ToolPlan(None, "", None)
FORCED_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")  # every API's tool-name rule, the widest
NAME_SLOT = "FORCEDTOOLNAME"  # where a format writes the name (a tool name, so written as is)


def forced_name(tool_choice: str | dict) -> str | None:
    return tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None


def plan_tools(support: ToolSupport, tools: tuple[dict, ...], tool_choice: str | dict) -> ToolPlan:
    """The prompt's tools and the reply's splitter for a request; a 400 for what cannot work."""
    if not tools or tool_choice == "none":
        return ToolPlan(None, "", HarmonySplitter({})) if support.harmony else NO_TOOLS
    if not support.local:
        raise InvalidRequestError(f"tools: {support.model} is served by its own server, which "
                                  f"this service does not pass tools to; leave tools out")
    if not support.uses_tools:
        raise InvalidRequestError(f"tools: {support.model} cannot take tools: its chat template "
                                  f"has no tool support")
    if support.format is None:
        raise InvalidRequestError(f"tools: {support.model} writes tool calls in a format this "
                                  f"server does not parse (hermes, qwen3_coder, llama3_json, harmony)")
    name = forced_name(tool_choice)  # one of `tools`: every API's schema checks that
    if name is not None and not FORCED_NAME.fullmatch(name):  # it is written as markup, unmarked
        raise InvalidRequestError(f"tool_choice: {name[:80]!r} is not a tool name (letters, "
                                  f"digits, '_', '-', '.')")
    schemas = {tool["function"]["name"]: tool["function"].get("parameters") or {} for tool in tools}
    splitter = (HarmonySplitter(schemas) if support.harmony
                else ToolCallSplitter(support.format, schemas))
    prefix = "" if tool_choice == "auto" else forced_opener(support.format, name)
    if prefix:
        splitter.feed("".join(prefix))  # the forced opener is the prompt's; the reply continues the call
    return ToolPlan(list(tools), prefix, splitter)


def forced_opener(tool_format: ToolFormat, name: str | None) -> str | tuple[str, str, str]:
    """The format's call opener; around a named tool, (markup, the name, markup), so the
    prompt marks the name as the client's text (chat_prompt.AssistantPrefix)."""
    if name is None:
        return tool_format.forced(None)
    before, found, after = tool_format.forced(NAME_SLOT).partition(NAME_SLOT)
    return (before, name, after) if found else tool_format.forced(name)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def split_calls(splitter: ToolCallSplitter | HarmonySplitter, text: str, finish: str | None
                ) -> tuple[str, str, tuple[ToolCallDelta, ...], str | None]:
    """A step's text without call markup, its reasoning (harmony's analysis), the calls it
    completed as OpenAI streams each (its id and name, then its arguments), and the finish
    reason ("tool_calls" for a reply that called)."""
    first_index = splitter.calls_made
    text, calls = splitter.feed(text)
    if finish:
        more, last = splitter.finish()
        text, calls = text + more, calls + last
    if finish == "stop" and splitter.calls_made:
        finish = "tool_calls"
    deltas = []
    for index, call in enumerate(calls, start=first_index):
        deltas += [ToolCallDelta(index, new_call_id(), call.name), ToolCallDelta(index, arguments=call.arguments)]
    return text, splitter.take_reasoning(), tuple(deltas), finish
