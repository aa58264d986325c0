"""A harmony (gpt-oss) reply split into what a client gets: content, reasoning and tool calls.

A harmony target's text keeps the format's special tokens (detokenize.py). A reply is a run of
messages, each `<|start|>ROLE HEADER<|message|>BODY` ended by `<|end|>`, `<|return|>` (the
reply's end) or `<|call|>` (a tool call); the prompt's `<|start|>assistant` opens the first.
The header names the channel (`<|channel|>analysis`, `commentary` or `final`) and, for a call,
the recipient (`to=functions.NAME`, after the role or the channel) and `<|constrain|>json`
(openai/harmony, docs/format.md: "Message format", "Channels", "Function calling"):

- an analysis body goes out as reasoning; a final body, or a commentary one without a recipient
  (a preamble the user may see), as content;
- a message to one of the request's functions, whole up to its `<|call|>`, becomes a call;
- anything else (a call with bad JSON, to an unknown function or cut off; a header that never
  reaches `<|message|>`; text outside the format) goes out as content, as the model wrote it.

Bodies stream as they come, holding back only a tail that could begin a marker; a header, and a
call's body, are held until they end.
"""

from __future__ import annotations

import re

from dflash_local.engines.detokenize import HARMONY_MARKERS
from dflash_local.service.tool_formats import Schemas, parse_harmony
from dflash_local.service.tool_stream import ParsedCall, ReplySplitter, parsed_calls

START, MESSAGE = "<|start|>", "<|message|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
# how a header begins: the reply's first (the prompt wrote `<|start|>assistant`), or a later
# one's role; text that begins otherwise is not the format
HEADER_STARTS = ("<|channel|>", " to=", "assistant")
HEADER_LIMIT = 256  # characters: a header this long without <|message|> is not one
CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
RECIPIENT = re.compile(r"\bto=\S")

REASONING, CONTENT, CALL = "reasoning", "content", "call"


class HarmonySplitter(ReplySplitter):
    """ToolCallSplitter's interface (feed: content and calls), plus the reasoning
    (take_reasoning); an unfinished header at the end goes out as text too."""

    def __init__(self, schemas: Schemas):
        self.schemas = schemas  # the request's tools ({}: none, every call is text)
        self._pending = ""
        self._header: str | None = ""  # the open message's header so far; None: past it
        self._opener = ""  # what opened it: "" (the prompt did) or <|start|>
        self._route: str | None = None  # where the open body goes; None: between messages
        self._call_markup = ""  # an open call's header, kept to go out as text if it fails
        self._reasoning: list[str] = []
        self.calls_made = 0

    def take_reasoning(self) -> str:
        reasoning = "".join(self._reasoning)
        self._reasoning.clear()
        return reasoning

    def _scan(self, final: bool) -> tuple[str, list[ParsedCall]]:
        out: list[str] = []
        calls: list[ParsedCall] = []
        while self._pending:
            if self._header is not None:
                progressed = self._read_header(out, final)
            elif self._route == CALL:
                progressed = self._read_call(out, calls, final)
            else:
                progressed = self._read_body(out, final)
            if not progressed:
                break
        return "".join(out), calls

    def _read_header(self, out: list[str], final: bool) -> bool:
        text = self._header + self._pending
        at, marker = _first(text, (MESSAGE, START, *ENDS))
        if marker == MESSAGE:
            header = text[:at]
            self._pending, self._header = text[at + len(MESSAGE):], None
            self._route = (CALL if RECIPIENT.search(header) else
                           REASONING if _channel(header) == "analysis" else CONTENT)
            self._call_markup = self._opener + header + MESSAGE
            return True
        if marker is not None or final or not _could_be_header(text):
            # not a header: its text is content, read as a body without one
            out.append(self._opener)
            self._pending, self._header, self._route, self._opener = text, None, CONTENT, ""
            return True
        self._header, self._pending = text, ""
        return False

    def _read_body(self, out: list[str], final: bool) -> bool:
        at, marker = _first(self._pending, (START, *ENDS))
        if marker is None:
            keep = 0 if final else _marker_tail(self._pending)
            self._send(out, self._pending[: len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep:]
            return False
        self._send(out, self._pending[:at])
        self._pending = self._pending[at + len(marker):]
        self._header, self._route = ("", None) if marker == START else (None, None)
        self._opener = marker if marker == START else ""
        return True

    def _read_call(self, out: list[str], calls: list[ParsedCall], final: bool) -> bool:
        at, marker = _first(self._pending, ENDS)
        if marker is None:
            if final:  # cut off before its <|call|>
                out.append(self._call_markup + self._pending)
                self._pending = ""
            return False
        markup = self._call_markup + self._pending[: at + len(marker)]
        self._pending, self._route = self._pending[at + len(marker):], None
        parsed = (parsed_calls(parse_harmony(markup, self.schemas), self.schemas)
                  if marker == "<|call|>" else None)
        if parsed is None:
            out.append(markup)
        else:
            calls += parsed
            self.calls_made += len(parsed)
        return True

    def _send(self, out: list[str], text: str) -> None:
        (self._reasoning if self._route == REASONING else out).append(text)


def split_reply(text: str) -> tuple[str, str]:
    """A whole reply's (content, reasoning), as the service sends them to a request without
    tools (a call is content, as the model wrote it): what a chat client keeps of it."""
    splitter = HarmonySplitter({})
    content, _ = splitter.feed(text)
    rest, _ = splitter.finish()
    return content + rest, splitter.take_reasoning()


def _first(text: str, markers: tuple[str, ...]) -> tuple[int, str | None]:
    hits = [(text.find(marker), marker) for marker in markers if marker in text]
    return min(hits) if hits else (-1, None)


def _channel(header: str) -> str | None:
    match = CHANNEL.search(header)
    return match[1] if match else None


def _could_be_header(text: str) -> bool:
    return len(text) < HEADER_LIMIT and any(
        text.startswith(start) or start.startswith(text) for start in HEADER_STARTS)


def _marker_tail(text: str) -> int:
    """How many of text's last characters could begin a harmony marker."""
    for keep in range(min(len(text), max(map(len, HARMONY_MARKERS)) - 1), 0, -1):
        if any(marker.startswith(text[-keep:]) for marker in HARMONY_MARKERS):
            return keep
    return 0
