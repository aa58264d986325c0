"""POST /v1/messages: the Anthropic Messages API over the same jobs as chat completions.

A reply is a list of content blocks (text, tool_use); streamed, it is Anthropic's event sequence:
message_start, then per block content_block_start / content_block_delta (text_delta or
input_json_delta) / content_block_stop, then message_delta (stop_reason, usage) and message_stop.
Each round's `dflash` object rides on the last event that round produced; a round that showed
nothing (an end-of-turn token, text a stop string holds back) sends an empty delta of the open
block, or a `ping` before the first block (SDK stream helpers drop pings: read raw events).
Errors on this path are reshaped into Anthropic's {"type": "error", "error": {...}}; a prompt
that does not fit is worded as Anthropic words it, which its clients parse (Claude Code retries
with a smaller `max_tokens`, or compacts on "prompt is too long"). A `max_tokens` past the room
left is lowered to it (the worker logs it), as the real API never meets a context this small.
POST /v1/messages/count_tokens renders the same prompt a request with that body would get.
Any model name is the loaded pair but another known pair's: agents send their own names.
"""

from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Request

from dflash_local.errors import InvalidRequestError, PromptTooLongError
from dflash_local.service import jobs
from dflash_local.service.anthropic_messages_schemas import CountTokensRequest, MessagesRequest
from dflash_local.service.api_errors import unexpected_error_response
from dflash_local.service.app_state import ServiceStateDep
from dflash_local.service.job_items import Chunk, JobRequest
from dflash_local.service.reply_constraint import reply_constraint
from dflash_local.service.sse import named_sse
from dflash_local.service.state import LoadedPair
from dflash_local.service.usage import step_dflash

MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
PING = named_sse({"type": "ping"})  # Anthropic's keep-alive event; its SDKs skip it
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error"}

router = APIRouter()


@router.post(MESSAGES_PATH)
async def messages(body: MessagesRequest, request: Request, state: ServiceStateDep):
    loaded = state.require_model(body.model)
    try:
        return await jobs.run(job_request(body, loaded), loaded, request,
                              lambda reply_id: MessagesEncoder(reply_id, loaded.served_name),
                              body.stream, id_prefix="msg_", keepalive=PING)
    except PromptTooLongError as exc:
        raise anthropic_context_error(exc) from None


@router.post(COUNT_TOKENS_PATH)
async def count_tokens(body: CountTokensRequest, state: ServiceStateDep) -> dict:
    loaded = state.require_model(body.model)
    counter = loaded.prompt_counter
    if counter is None:
        raise InvalidRequestError(f"count_tokens: {loaded.served_name} is served by its own "
                                  f"server, whose tokenizer this service does not hold")
    request = job_request(body, loaded)
    try:  # off the event loop: a long conversation takes the template a while
        prompt_ids = await asyncio.to_thread(counter.prompt_ids, request)
    except PromptTooLongError as exc:
        raise anthropic_context_error(exc) from None
    return {"input_tokens": len(prompt_ids)}


def job_request(body: MessagesRequest, loaded: LoadedPair) -> JobRequest:
    tools = body.job_tools()
    constraint, thinking = reply_constraint(loaded, body.text_constraint(), tools,
                                            body.job_tool_choice(), body.enforced_tools(),
                                            body.thinking_mode(), MESSAGES_PATH)
    params = jobs.generation_params(body, loaded, body.max_tokens, body.temperature, body.top_p,
                                    top_k=body.top_k, constraint=constraint)
    messages = body.template_messages(loaded.system_turns, loaded.served_name)
    return JobRequest(messages=messages, params=params, max_tokens_given=True,
                      thinking=thinking, stop=tuple(body.stop_sequences or ()),
                      tools=tools, tool_choice=body.job_tool_choice())


def anthropic_context_error(exc: PromptTooLongError) -> PromptTooLongError:
    """The error in the words of Anthropic's API, which Claude Code matches to recover."""
    prompt, asked, context = exc.prompt_tokens, exc.max_tokens, exc.max_context
    if prompt is not None and asked is not None and context is not None:
        message = (f"input length and `max_tokens` exceed context limit: {prompt} + {asked} > "
                   f"{context}, decrease input length or `max_tokens` and try again")
    elif prompt is not None and context is not None:  # at least one token must be left to reply
        message = f"prompt is too long: {prompt} tokens > {context - 1} maximum"
    else:
        message = f"prompt is too long: {exc}"
    return PromptTooLongError(message, prompt, asked, context)


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(finish_reason: str | None, stop_sequence: str | None) -> str | None:
    return "stop_sequence" if stop_sequence else STOP_REASONS.get(finish_reason, finish_reason)


def anthropic_usage(usage: dict) -> dict:
    """Anthropic counts the prompt's cached tokens apart from `input_tokens`."""
    return {**token_counts(usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
                           usage["completion_tokens"]), "dflash": usage["dflash"]}


def token_counts(prompt_tokens: int, cached: int, output_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


class MessagesEncoder:
    def __init__(self, reply_id: str, model: str):
        self.reply_id = reply_id
        self.model = model
        self.started = False  # message_start sent
        self.blocks = 0  # content blocks opened so far
        self.open_kind: str | None = None  # "text" or "tool_use": the block taking deltas
        self.finish: tuple[str | None, str | None] = (None, None)

    def message(self, content: list, stop: str | None, stop_sequence: str | None,
                usage: dict) -> dict:
        return {"id": self.reply_id, "type": "message", "role": "assistant", "content": content,
                "model": self.model, "stop_reason": stop, "stop_sequence": stop_sequence,
                "usage": usage}

    # --- streamed ---

    def chunk(self, chunk: Chunk) -> bytes:
        events = []
        if not self.started:  # the first chunk is the prefill's: it knows the prompt's size
            self.started = True
            usage = token_counts(chunk.event.prompt_tokens, chunk.event.cached_tokens, 0)
            events.append({"type": "message_start", "message": self.message([], None, None, usage)})
        if chunk.text:
            events += self._text(chunk.text)
        for delta in chunk.tool_calls:
            events += self._tool_delta(delta)
        if chunk.finish_reason:
            self.finish = (chunk.finish_reason, chunk.stop_sequence)
        if not events:
            events.append(self._empty_delta())
        events[-1]["dflash"] = step_dflash(chunk.event)  # each event is this chunk's own dict
        return b"".join(named_sse(e) for e in events)

    def _empty_delta(self) -> dict:
        """Carries a round that showed nothing: an empty delta of the open block, else a ping."""
        if self.open_kind is None:
            return {"type": "ping"}
        delta = {"type": "text_delta", "text": ""} if self.open_kind == "text" else \
            {"type": "input_json_delta", "partial_json": ""}
        return {"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}

    def _text(self, text: str) -> list[dict]:
        events = [] if self.open_kind == "text" else self._open({"type": "text", "text": ""})
        return events + [{"type": "content_block_delta", "index": self.blocks - 1,
                          "delta": {"type": "text_delta", "text": text}}]

    def _tool_delta(self, delta) -> list[dict]:
        events = []
        if delta.id is not None:  # a call's first piece opens its own block
            events += self._open({"type": "tool_use", "id": tool_use_id(delta.id), "name": delta.name,
                                  "input": {}})
        if delta.arguments:
            events.append({"type": "content_block_delta", "index": self.blocks - 1,
                           "delta": {"type": "input_json_delta", "partial_json": delta.arguments}})
        return events

    def _open(self, block: dict) -> list[dict]:
        events = self._close()
        self.open_kind = block["type"]
        self.blocks += 1
        return events + [{"type": "content_block_start", "index": self.blocks - 1,
                          "content_block": block}]

    def _close(self) -> list[dict]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [{"type": "content_block_stop", "index": self.blocks - 1}]

    def finished(self, usage: dict) -> bytes:
        finish_reason, stop_sequence = self.finish
        events = self._close() + [
            {"type": "message_delta",
             "delta": {"stop_reason": stop_reason(finish_reason, stop_sequence),
                       "stop_sequence": stop_sequence},
             "usage": anthropic_usage(usage)},
            {"type": "message_stop"}]
        return b"".join(named_sse(e) for e in events)

    def failed(self, status: int, message: str, code: str | None) -> bytes:
        return named_sse({"type": "error", "error": {
            "type": ERROR_TYPES.get(status, "api_error"), "message": message}})

    # --- one body ---

    def body(self, reply: jobs.Reply, usage: dict) -> dict:
        calls = reply.tool_calls()
        content = [{"type": "text", "text": reply.text}] if jobs.shows_text(reply.text, calls) else []
        content += [{"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"],
                     "input": json.loads(call["function"]["arguments"] or "{}")} for call in calls]
        return self.message(content, stop_reason(reply.finish_reason, reply.stop_sequence),
                            reply.stop_sequence, anthropic_usage(usage))


def anthropic_error(status: int, body: bytes) -> bytes:
    """Our OpenAI-style error body as Anthropic's; anything else as it was."""
    try:
        error = json.loads(body)["error"]
        message = error["message"]
    except (ValueError, KeyError, TypeError):
        return body
    return json.dumps({"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"),
                                                  "message": message}}).encode()


class AnthropicErrors:
    """Pure ASGI: on /v1/messages (and its count_tokens), every error response (a guard's, the key's, validation's, a
    route's) leaves in Anthropic's shape. Only error bodies are held; streams pass untouched."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in (MESSAGES_PATH, COUNT_TOKENS_PATH):
            return await self.app(scope, receive, send)
        held: dict = {}
        parts: list[bytes] = []

        async def reshaping_send(message):
            if message["type"] == "http.response.start" and message["status"] >= 400:
                held["start"] = message
                return
            if "start" not in held:
                held["sent"] = True
                return await send(message)
            parts.append(message.get("body", b""))
            if message.get("more_body"):
                return
            start = held["start"]
            payload = anthropic_error(start["status"], b"".join(parts))
            headers = [(name, value) for name, value in start["headers"]
                       if name.lower() != b"content-length"]
            await send({**start, "headers": headers + [(b"content-length", str(len(payload)).encode())]})
            await send({"type": "http.response.body", "body": payload})

        try:
            return await self.app(scope, receive, reshaping_send)
        except Exception as exc:  # the app's catch-all answers outside this middleware: here, too
            if held.get("sent"):
                raise
            return await unexpected_error_response(exc)(scope, receive, reshaping_send)
