"""Splits a streamed reply into its text and the tool calls its markup writes.

Text flows out as it comes, except a tail that could begin a call's opener (held back as
StopMatcher holds back a stop string's start). From an opener on, the markup is held until its
closer (or the reply's end, for a format without one); a whole call then parses into
ParsedCalls, or, malformed (bad JSON, an unknown tool, never closed), goes out as the text it was:
a model's broken call is its reply, never an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from dflash_local.service.tool_formats import Calls, Schemas, ToolFormat


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # the arguments object as JSON text, as OpenAI's `function.arguments`


class ReplySplitter:
    """Fed a reply's text as it comes: `_scan` says what may go out so far, or all at the end."""

    _pending: str

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        """(text safe to emit, calls completed) after `text`."""
        self._pending += text
        return self._scan(final=False)

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """The reply ended: what is held goes out, an unfinished call as text."""
        return self._scan(final=True)

    def _scan(self, final: bool) -> tuple[str, list[ParsedCall]]:
        raise NotImplementedError


class ToolCallSplitter(ReplySplitter):
    def __init__(self, tool_format: ToolFormat, schemas: Schemas):
        self.format = tool_format
        self.schemas = schemas  # the request's tools: a call to any other name is text
        self._pending = ""  # not yet out: a possible opener's start, or a call's markup
        self._opener: str | None = None  # the opener `_pending` starts with, inside a call
        self._at_start = True  # nothing but whitespace out yet
        self.calls_made = 0

    def _scan(self, final: bool) -> tuple[str, list[ParsedCall]]:
        out: list[str] = []
        calls: list[ParsedCall] = []
        while True:
            if self._opener is None:
                position, opener = self._find_opener()
                if opener is None:
                    keep = 0 if final else self._held_tail()
                    self._emit(out, self._pending[: len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep:]
                    break
                self._emit(out, self._pending[:position])
                self._pending, self._opener = self._pending[position:], opener
            end = self._closer_end()
            if self.format.not_a_call(self._pending[:end]):  # out goes the opener, the rest rescanned
                self._emit(out, self._opener)
                self._pending, self._opener = self._pending[len(self._opener):], None
                continue
            if end is None:
                if not final:
                    break
                end = len(self._pending)  # the reply ended inside the markup
            markup, self._pending, self._opener = self._pending[:end], self._pending[end:], None
            closed = not self.format.closers or markup.endswith(self.format.closers)
            parsed = self._parse(markup) if closed else None
            if parsed is None:
                self._emit(out, markup)
            else:
                calls += parsed
                self.calls_made += len(parsed)
                self._at_start = False
        return "".join(out), calls

    def _emit(self, out: list[str], text: str) -> None:
        out.append(text)
        if text.strip():
            self._at_start = False

    def _find_opener(self) -> tuple[int, str | None]:
        text = self._pending
        if self.format.reply_start_only:
            if not self._at_start:
                return -1, None
            stripped = text.lstrip()  # leading whitespace is part of the markup
            return 0, next((o for o in self.format.openers if stripped.startswith(o)), None)
        found = [(text.find(opener), opener) for opener in self.format.openers if opener in text]
        return min(found, key=lambda hit: (hit[0], -len(hit[1]))) if found else (-1, None)

    def _held_tail(self) -> int:
        """How many of `_pending`'s last characters could begin an opener."""
        text = self._pending
        if self.format.reply_start_only:
            stripped = text.lstrip()
            if self._at_start and any(o.startswith(stripped) for o in self.format.openers):
                return len(text)  # whitespace and a partial opener: undecided yet
            return 0
        for keep in range(min(len(text), max(map(len, self.format.openers)) - 1), 0, -1):
            if any(opener.startswith(text[-keep:]) for opener in self.format.openers):
                return keep
        return 0

    def _closer_end(self) -> int | None:
        """Where the held call's markup ends (past its closer), if its closer has come."""
        ends = [self._pending.find(closer, len(self._opener)) for closer in self.format.closers]
        hits = [(at, closer) for at, closer in zip(ends, self.format.closers, strict=True) if at >= 0]
        if not hits:
            return None
        at, closer = min(hits)
        return at + len(closer)

    def _parse(self, markup: str) -> list[ParsedCall] | None:
        return parsed_calls(self.format.parse(markup, self.schemas), self.schemas)

    def take_reasoning(self) -> str:
        return ""  # these formats have no reasoning channel (harmony's has: service/harmony.py)


def parsed_calls(calls: Calls | None, schemas: Schemas) -> list[ParsedCall] | None:
    """A format's parsed calls as OpenAI's; None (the markup is text) for none or a call to a
    function the request did not give."""
    if not calls or any(name not in schemas for name, _ in calls):
        return None
    return [ParsedCall(name, json.dumps(arguments, ensure_ascii=False)) for name, arguments in calls]
