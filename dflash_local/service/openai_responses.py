"""POST /v1/responses: OpenAI's Responses API (stateless) over the same jobs as chat completions.

A reply is a `response` whose `output` holds a message item (one output_text part) and/or call
items: function_call, or custom_tool_call for a custom tool, each with its tool's `namespace`
when it came from one. Streamed, it is OpenAI's event sequence, each with a `sequence_number`:
response.created, response.in_progress, then per item output_item.added, (content_part.added,
output_text.delta..., output_text.done, content_part.done | function_call_arguments.delta...,
function_call_arguments.done | custom_tool_call_input.delta, custom_tool_call_input.done),
output_item.done, and last response.completed (or response.incomplete when max_output_tokens cut
the reply, or its grammar admitted no next token). A custom call's input is sent whole when the call ends (the model writes it as JSON
text). Each round's `dflash` object rides on the last event it produced; a round that showed
nothing sends an empty delta of the open item, or another response.in_progress before the first
item. `dflash_notes` in the response lists where the model was told otherwise than the request
asked (a built-in tool left out, a grammar not enforced...); each note is logged once. Model
names and the context's limits are chat's rules (openai_chat.py), refused in this API's words.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request

from dflash_local.errors import PromptTooLongError
from dflash_local.method.constraint import DEAD_END
from dflash_local.service import jobs
from dflash_local.service.api_errors import log_notes
from dflash_local.service.app_state import ServiceStateDep
from dflash_local.service.job_items import Chunk, JobRequest, ToolCallDelta
from dflash_local.service.openai_responses_schemas import ResponsesRequest
from dflash_local.service.openai_responses_tools import OfferedTool, custom_input
from dflash_local.service.reply_constraint import reply_constraint
from dflash_local.service.sse import named_sse
from dflash_local.service.state import LoadedPair
from dflash_local.service.usage import step_dflash
from dflash_local.service.validation import shown_value

router = APIRouter()
# a reply cut short: by max_output_tokens, or where its grammar admitted no token (DEAD_END)
INCOMPLETE_REASONS = {"length": "max_output_tokens", DEAD_END: DEAD_END}
RESPONSES_PATH = "/v1/responses"


@router.post(RESPONSES_PATH)
async def create_response(body: ResponsesRequest, request: Request, state: ServiceStateDep):
    loaded = state.require_model(body.model)
    notes = tuple(body.notes() + thinking_notes(body, loaded))
    log_notes(notes, RESPONSES_PATH)
    try:
        return await jobs.run(job_request(body, loaded), loaded, request,
                              lambda reply_id: ResponsesEncoder(reply_id, loaded.served_name, body, notes),
                              body.stream, id_prefix="resp_")
    except PromptTooLongError as exc:
        raise responses_context_error(exc) from None


def responses_context_error(exc: PromptTooLongError) -> PromptTooLongError:
    """A prompt that leaves no room to reply (a max_output_tokens past the room is lowered to
    it), in the Responses API's words; Codex reads the code, context_length_exceeded."""
    prompt, context = exc.prompt_tokens, exc.max_context
    counts = f"{prompt} tokens > {context - 1} maximum" if prompt is not None and context else str(exc)
    return PromptTooLongError(f"Your input exceeds the context window of this model ({counts}). "
                              f"Please adjust your input and try again.", prompt, exc.max_tokens, context)


def job_request(body: ResponsesRequest, loaded: LoadedPair) -> JobRequest:
    max_tokens = body.max_output_tokens
    if max_tokens is None and loaded.engine.capabilities.tokenizes:
        # OpenAI's default is the model's limit: Codex sends none and expects a long patch to
        # fit; the worker caps it to the room the prompt leaves
        max_tokens = loaded.engine.capabilities.max_context
    tools = body.job_tools()
    constraint, thinking = reply_constraint(loaded, body.text_constraint(), tools,
                                            body.job_tool_choice(), body.enforced_tools(),
                                            body.thinking(), RESPONSES_PATH)
    params = jobs.generation_params(body, loaded, max_tokens, body.temperature, body.top_p,
                                    constraint=constraint)
    return JobRequest(messages=body.template_messages(), params=params,
                      max_tokens_given=body.max_output_tokens is not None, thinking=thinking,
                      tools=tools, tool_choice=body.job_tool_choice())


def thinking_notes(body: ResponsesRequest, loaded: LoadedPair) -> list[str]:
    """reasoning.effort switches the template's thinking; a template without the switch ignores it."""
    if body.thinking() is None or not loaded.engine.capabilities.tokenizes:
        return []  # a served engine gets it as chat_template_kwargs.enable_thinking
    template = getattr(loaded.engine.tokenizer, "chat_template", None) or ""
    if "enable_thinking" in template:
        return []
    note = (f"reasoning.effort {shown_value(body.reasoning.effort)}: the target's chat template "
            f"has no thinking switch; the effort changes nothing")
    return [note]


def responses_usage(usage: dict) -> dict:
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                                     "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"], "dflash": usage["dflash"]}


def message_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [text_part(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call: dict, status: str, tool: OfferedTool | None) -> dict:
    """`call` in OpenAI chat's whole form (jobs.whole_tool_calls), as the item its tool's kind
    answers with: a function_call, or a custom_tool_call whose input the model wrote as `input`."""
    name, arguments = call["function"]["name"], call["function"]["arguments"]
    if tool is not None and tool.custom:
        item = {"type": "custom_tool_call", "id": item_id, "call_id": call["id"], "name": name,
                "input": custom_input(arguments) if status == "completed" else "", "status": status}
    else:
        item = {"type": "function_call", "id": item_id, "call_id": call["id"], "name": name,
                "arguments": arguments, "status": status}
    if tool is not None and tool.namespace is not None:
        item["namespace"] = tool.namespace
    return item


def request_settings(body: ResponsesRequest) -> dict:
    return {"instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p,
            "tool_choice": body.tool_choice if isinstance(body.tool_choice, str)
            else body.tool_choice.model_dump() if body.tool_choice else "auto",
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
            "reasoning": body.reasoning.model_dump() if body.reasoning else None,
            "parallel_tool_calls": True, "previous_response_id": None, "store": False,
            "text": {"format": body.text_format()}, "truncation": "disabled", "metadata": {}}


class ResponsesEncoder:
    def __init__(self, reply_id: str, model: str, body: ResponsesRequest, notes: tuple[str, ...] = ()):
        self.reply_id = reply_id
        self.model = model
        # the request's settings every `response` object echoes: shaped once, not per event
        self.settings = {**request_settings(body), "dflash_notes": list(notes)}
        self.tools = body.offered_tools()
        self.created_at = int(time.time())
        self.started = False
        self.sequence = 0
        self.items: list[dict] = []  # output items, the last one open while streaming
        self.text_parts: list[str] = []  # the open message's text so far
        self.tool_deltas: list[ToolCallDelta] = []
        self.finish_reason: str | None = None

    def response(self, status: str, output: list[dict], usage: dict | None = None) -> dict:
        return {"id": self.reply_id, "object": "response", "created_at": self.created_at,
                "status": status, "model": self.model, "output": output, "usage": usage,
                "error": None,
                "incomplete_details": ({"reason": INCOMPLETE_REASONS[self.finish_reason]}
                                       if status == "incomplete" else None),
                **self.settings}

    def _item_id(self, kind: str, output_index: int) -> str:
        """An output item's id: its kind ("msg", "fc", "ctc"), the reply's, its place in `output`."""
        return f"{kind}_{self.reply_id.removeprefix('resp_')}_{output_index}"

    def _status(self) -> str:
        return "incomplete" if self.finish_reason in INCOMPLETE_REASONS else "completed"

    # --- streamed ---

    def _event(self, payload: dict) -> dict:
        self.sequence += 1
        return {**payload, "sequence_number": self.sequence - 1}

    def chunk(self, chunk: Chunk) -> bytes:
        events = []
        if not self.started:
            self.started = True
            events += [self._event({"type": "response.created", "response": self.response("in_progress", [])}),
                       self._event({"type": "response.in_progress",
                                    "response": self.response("in_progress", [])})]
        shown = len(events)
        if chunk.text:
            events += self._text(chunk.text)
        for delta in chunk.tool_calls:
            events += self._tool_delta(delta)
        self.finish_reason = chunk.finish_reason or self.finish_reason
        if len(events) == shown:
            events.append(self._empty_delta())
        events[-1]["dflash"] = step_dflash(chunk.event)
        return b"".join(named_sse(e) for e in events)

    def _where(self) -> dict:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _empty_delta(self) -> dict:
        if not self.items:
            return self._event({"type": "response.in_progress", "response": self.response("in_progress", [])})
        kind = self.items[-1]["type"]
        if kind == "message":
            return self._event({"type": "response.output_text.delta", **self._where(),
                                "content_index": 0, "delta": "", "logprobs": []})
        if kind == "custom_tool_call":
            return self._event({"type": "response.custom_tool_call_input.delta", **self._where(), "delta": ""})
        return self._event({"type": "response.function_call_arguments.delta", **self._where(), "delta": ""})

    def _text(self, text: str) -> list[dict]:
        events = []
        if not self.items or self.items[-1]["type"] != "message":
            events += self._open(message_item(self._item_id("msg", len(self.items)), None,
                                               "in_progress"))
            events.append(self._event({"type": "response.content_part.added", **self._where(),
                                       "content_index": 0, "part": text_part("")}))
        self.text_parts.append(text)
        return events + [self._event({"type": "response.output_text.delta", **self._where(),
                                      "content_index": 0, "delta": text, "logprobs": []})]

    def _tool_delta(self, delta: ToolCallDelta) -> list[dict]:
        events = []
        if delta.id is not None:  # a call's first piece opens its own item (closing the one before)
            events += self._open(self._call_item(
                {"id": delta.id, "function": {"name": delta.name, "arguments": ""}},
                len(self.items), "in_progress"))
        self.tool_deltas.append(delta)  # after the close: the closed call is the last one there
        # a custom call's input is JSON text until the call ends: sent whole then (_close)
        if delta.arguments and self.items[-1]["type"] == "function_call":
            events.append(self._event({"type": "response.function_call_arguments.delta", **self._where(),
                                       "delta": delta.arguments}))
        return events

    def _open(self, item: dict) -> list[dict]:
        events = self._close()
        self.items.append(item)
        return events + [self._event({"type": "response.output_item.added",
                                      "output_index": len(self.items) - 1, "item": item})]

    def _close(self) -> list[dict]:
        """The open item's closing events; the item is replaced by its finished form."""
        if not self.items or self.items[-1]["status"] != "in_progress":
            return []
        item, where, status = self.items[-1], self._where(), self._status()
        events = []
        if item["type"] == "message":
            text, self.text_parts = "".join(self.text_parts), []
            events += [self._event({"type": "response.output_text.done", **where, "content_index": 0,
                                    "text": text, "logprobs": []}),
                       self._event({"type": "response.content_part.done", **where, "content_index": 0,
                                    "part": text_part(text)})]
            done = message_item(item["id"], text, status)
        else:
            call = jobs.whole_tool_calls(tuple(self.tool_deltas))[-1]
            done = call_item(item["id"], call, "completed", self.tools.get(call["function"]["name"]))
            events += self._call_done_events(done, where)
        self.items[-1] = done
        return events + [self._event({"type": "response.output_item.done",
                                      "output_index": where["output_index"], "item": done})]

    def _call_done_events(self, done: dict, where: dict) -> list[dict]:
        if done["type"] == "custom_tool_call":
            return [self._event({"type": "response.custom_tool_call_input.delta", **where,
                                 "delta": done["input"]}),
                    self._event({"type": "response.custom_tool_call_input.done", **where,
                                 "input": done["input"]})]
        return [self._event({"type": "response.function_call_arguments.done", **where,
                             "name": done["name"], "arguments": done["arguments"]})]

    def _call_item(self, call: dict, output_index: int, status: str) -> dict:
        tool = self.tools.get(call["function"]["name"])
        kind = "ctc" if tool is not None and tool.custom else "fc"
        return call_item(self._item_id(kind, output_index), call, status, tool)

    def finished(self, usage: dict) -> bytes:
        events = self._close()
        status = self._status()
        kind = "response.completed" if status == "completed" else "response.incomplete"
        events.append(self._event({"type": kind, "response": self.response(
            status, self.items, responses_usage(usage))}))
        return b"".join(named_sse(e) for e in events)

    def failed(self, status: int, message: str, code: str | None) -> bytes:
        return named_sse(self._event({"type": "error", "code": code or "server_error",
                                                "message": message, "param": None}))

    # --- one body ---

    def body(self, reply: jobs.Reply, usage: dict) -> dict:
        self.finish_reason = reply.finish_reason
        status = self._status()
        calls = reply.tool_calls()
        output = [message_item(self._item_id("msg", 0), reply.text, status)] \
            if jobs.shows_text(reply.text, calls) else []
        output += [self._call_item(call, len(output) + index, "completed")
                   for index, call in enumerate(calls)]
        return self.response(status, output, responses_usage(usage))
