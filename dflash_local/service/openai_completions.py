"""POST /v1/completions: OpenAI's legacy completions. A raw prompt (text or token ids, no chat
template) continued by the same speculative loop; the reply as `text_completion` objects
(chunks ending in `[DONE]`, or one body).

`echo` puts the prompt before the reply's text; `logprobs` (the legacy form: tokens,
token_logprobs, top_logprobs, text_offset) covers the reply's tokens and, with echo, the
prompt's own, the first one null, as vLLM reports them (raw_prompt.py): what lm-eval's
loglikelihood tasks read. The job plumbing is jobs.py's, as for every API.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from dflash_local.errors import InvalidRequestError, PromptTooLongError
from dflash_local.service import jobs
from dflash_local.service.api_errors import error_body
from dflash_local.service.app_state import ServiceStateDep
from dflash_local.service.job_items import Chunk, JobRequest
from dflash_local.service.openai_completions_schemas import DEFAULT_MAX_TOKENS, CompletionRequest
from dflash_local.service.raw_prompt import PromptEcho, RawPrompt
from dflash_local.service.reply_constraint import reply_constraint
from dflash_local.service.sse import sse
from dflash_local.service.state import LoadedPair
from dflash_local.service.usage import step_dflash

router = APIRouter()
COMPLETIONS_PATH = "/v1/completions"
ID_PREFIX = "cmpl-"


@router.post(COMPLETIONS_PATH)
async def completions(body: CompletionRequest, request: Request, state: ServiceStateDep):
    loaded = state.require_model(body.model)
    if loaded.prompt_counter is None or not loaded.engine.capabilities.logprobs:
        raise InvalidRequestError(f"/v1/completions runs token ids as given, on a local engine; "
                                  f"the loaded {loaded.engine.name} engine relays a server's text")
    prompts = body.prompts()
    fields = [f"prompt.{index}" for index in range(len(prompts))] if len(prompts) > 1 else ["prompt"]
    raw_prompts = [await raw_prompt(prompt, loaded, body.echo, field)
                   for prompt, field in zip(prompts, fields, strict=True)]
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def encoder_of(index: int):
        return lambda reply_id: CompletionEncoder(reply_id, loaded.served_name, include_usage,
                                                  body.logprobs is not None, index)

    if len(raw_prompts) == 1:
        return await jobs.run(job_request(body, loaded, raw_prompts[0]), loaded, request,
                              encoder_of(0), body.stream, id_prefix=ID_PREFIX)
    try:  # one generation after another, each a choice (never streamed: the schema refuses)
        bodies = [await jobs.reply_body(job_request(body, loaded, prompt), loaded, request,
                                        encoder_of(index), id_prefix=ID_PREFIX)
                  for index, prompt in enumerate(raw_prompts)]
    except jobs.ClientDisconnected:
        return Response(status_code=jobs.CLIENT_CLOSED)
    return JSONResponse(joined_bodies(bodies))


async def raw_prompt(prompt: str | list[int], loaded: LoadedPair, echo: bool,
                     field: str) -> RawPrompt:
    """A prompt's ids: text tokenized as it is (with the counter's tokenizer, off the event
    loop), ids checked against the vocabulary (the tokenizer's and the embedding's); either way
    refused here, before it queues, when it leaves the completion no room."""
    if isinstance(prompt, str):
        ids = await asyncio.to_thread(loaded.prompt_counter.encode_text, prompt)
        if not ids:
            raise InvalidRequestError(f"{field}: {prompt!r} encodes to no tokens")
    else:
        ids = prompt
        limit = loaded.engine.token_id_limit
        for position, token_id in enumerate(ids):
            if token_id >= limit:
                raise InvalidRequestError(f"{field}: token id {token_id} (position {position}) "
                                          f"is outside the vocabulary: ids are 0 to {limit - 1}")
    check_room(len(ids), loaded.engine.capabilities.max_context, field)
    return RawPrompt(tuple(ids), prompt if isinstance(prompt, str) else None, echo)


def check_room(prompt_tokens: int, context: int, field: str) -> None:
    """A prompt that leaves no row to generate in, in OpenAI's words (litellm's
    ContextWindowExceededError matches them); a max_tokens past the room is lowered instead."""
    if prompt_tokens >= context:
        raise PromptTooLongError(
            f"This model's maximum context length is {context} tokens. However, your prompt "
            f"({field}) resulted in {prompt_tokens} tokens, leaving none for the completion. "
            f"Please reduce the length of the prompt.",
            prompt_tokens=prompt_tokens, max_context=context)


def job_request(body: CompletionRequest, loaded: LoadedPair, prompt: RawPrompt) -> JobRequest:
    constraint, _thinking = reply_constraint(loaded, body.text_constraint(), (), "auto", {}, None,
                                             COMPLETIONS_PATH)
    params = jobs.generation_params(body, loaded, body.max_tokens or DEFAULT_MAX_TOKENS,
                                    body.temperature, body.top_p, seed=body.seed,
                                    logprobs=body.logprobs, constraint=constraint)
    return JobRequest(messages=[], params=params, max_tokens_given=body.max_tokens is not None,
                      stop=body.stop_strings(), raw_prompt=prompt)


def joined_bodies(bodies: list[dict]) -> dict:
    """Several prompts' replies as one: a choice each, in order, each with its own `dflash`
    totals; usage sums their counts."""
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    usage = {name: sum(body["usage"][name] for body in bodies) for name in counts}
    usage["prompt_tokens_details"] = {"cached_tokens": sum(
        body["usage"]["prompt_tokens_details"]["cached_tokens"] for body in bodies)}
    choices = [{**body["choices"][0], "dflash": body["usage"]["dflash"]} for body in bodies]
    return {**bodies[0], "choices": choices, "usage": usage}


class CompletionEncoder:
    """text_completion chunks ending in `[DONE]`, or one text_completion body."""

    def __init__(self, reply_id: str, model: str, include_usage: bool, logprobs: bool,
                 index: int = 0):
        self.reply_id = reply_id
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage
        self.logprobs = logprobs  # asked for: each chunk carries its text's entries
        self.index = index  # which prompt of the request
        self._echoed_chars = 0  # the echoed prompt's text, before the reply's in offsets

    def _base(self) -> dict:
        return {"id": self.reply_id, "object": "text_completion", "created": self.created,
                "model": self.model}

    def _choice(self, text: str, entries, echo: PromptEcho | None, finish: str | None) -> dict:
        entries = [{**entry, "text_offset": entry["text_offset"] + self._echoed_chars}
                   for entry in entries]
        if echo is not None:
            text, entries = echo.text + text, [*echo.entries, *entries]
        return {"text": text, "index": self.index,
                "logprobs": legacy_logprobs(entries) if self.logprobs else None,
                "finish_reason": finish}

    def _echo(self, echo: PromptEcho | None) -> None:
        if echo is not None:
            self._echoed_chars = len(echo.text)

    def chunk(self, chunk: Chunk) -> bytes:
        self._echo(chunk.echo)
        choice = self._choice(chunk.text, chunk.logprobs, chunk.echo, chunk.finish_reason)
        return sse({**self._base(), "choices": [choice], "dflash": step_dflash(chunk.event)})

    def finished(self, usage: dict) -> bytes:
        events = sse({**self._base(), "choices": [], "usage": usage}) if self.include_usage else b""
        return events + sse("[DONE]")

    def failed(self, status: int, message: str, code: str | None) -> bytes:
        return sse(error_body(status, message, code)) + sse("[DONE]")

    def body(self, reply: jobs.Reply, usage: dict) -> dict:
        self._echo(reply.echo)
        choice = self._choice(reply.text, reply.logprobs, reply.echo, reply.finish_reason)
        return {**self._base(), "choices": [choice], "usage": usage}


def legacy_logprobs(entries: list[dict]) -> dict:
    """The legacy `logprobs` object from our entries (logprob_entries.py). A token's
    alternatives always include the token itself, as vLLM's do; a prompt's first token has
    null for both."""
    top = []
    for entry in entries:
        alternatives = None
        if entry["top_logprobs"] is not None:
            alternatives = {item["token"]: item["logprob"] for item in entry["top_logprobs"]}
            alternatives.setdefault(entry["token"], entry["logprob"])
        top.append(alternatives)
    return {"tokens": [entry["token"] for entry in entries],
            "token_logprobs": [entry["logprob"] for entry in entries],
            "top_logprobs": top,
            "text_offset": [entry["text_offset"] for entry in entries]}
