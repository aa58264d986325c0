"""Counting beside the worker without touching the worker's tokenizer: POST
/v1/messages/count_tokens' count (the very prompt a generation would get), every generating
request's early size check (jobs.run), and a completion's text prompt as ids.

A Hugging Face fast tokenizer keeps a per-call setting (split_special_tokens) on its backend
object, so two threads encoding with one tokenizer can change each other's ids. The counter
encodes with its own copy of the tokenizer, through the engine's own encode_chat, one count at
a time.
"""

from __future__ import annotations

import copy
import threading

from dflash_local.service.tool_calls import ToolSupport, plan_tools
from dflash_local.service.worker import JobRequest, encode_prompt


class PromptCounter:
    @classmethod
    def of(cls, engine, tool_support: ToolSupport) -> PromptCounter | None:
        """Made at load, while no job uses the tokenizer; None for an engine that does not
        tokenize (a served engine's tokenizer is its server's)."""
        if not engine.capabilities.tokenizes or getattr(engine, "tokenizer", None) is None:
            return None
        return cls(engine, tool_support)

    def __init__(self, engine, tool_support: ToolSupport):
        # a shallow copy shares the weights; only the tokenizer is its own
        self._engine = copy.copy(engine)
        self._engine.tokenizer = copy.deepcopy(engine.tokenizer)
        self._tool_support = tool_support
        self._lock = threading.Lock()

    def prompt_ids(self, request: JobRequest) -> list[int]:
        """Blocking (a long conversation takes the template a while): call it from a thread."""
        tools = plan_tools(self._tool_support, request.tools, request.tool_choice)
        with self._lock:
            return encode_prompt(self._engine, request, tools)

    def encode_text(self, text: str) -> list[int]:
        """A completion's prompt as it is, no template (blocking)."""
        with self._lock:
            return self._engine.encode_raw(text)

    def check_size(self, messages: list[dict], tools: list[dict]) -> None:
        """The engine's early refusal of a body that cannot fit the context (blocking)."""
        with self._lock:
            self._engine.check_request_size(messages, tools)
