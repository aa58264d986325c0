"""How `dflash-local generate` takes a reply apart and prints it as it streams.

A harmony target's text (gpt-oss: it keeps the format's markers, detokenize.py) is split as
the service splits it (service/harmony.py): the final channel is the answer, the analysis
channel the reasoning; with no tools given, a call stays text. Any other target's text is all
answer. The answer goes to stdout and the reasoning to stderr, dimmed on a terminal, so a pipe
or a file gets the answer alone.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from dflash_local.service.harmony import HarmonySplitter

DIM, NORMAL = "\x1b[2m", "\x1b[0m"


@dataclass(frozen=True)
class Reply:
    text: str  # the answer: a harmony target's final channel, else the whole text
    reasoning: str | None  # a harmony target's analysis channel; None: the target has none


class ReplyEcho:
    """The answer to stdout, the reasoning to stderr (dimmed on a terminal), each as it comes."""

    def __init__(self):
        self._dim = sys.stderr.isatty()
        self._in_reasoning = False  # reasoning printed, its line not ended yet

    def write(self, answer: str, reasoning: str) -> None:
        if reasoning:
            opening = DIM if self._dim and not self._in_reasoning else ""
            sys.stderr.write(opening + reasoning)
            sys.stderr.flush()
            self._in_reasoning = True
        if answer:
            self._end_reasoning()
            sys.stdout.write(answer)
            sys.stdout.flush()

    def close(self) -> None:
        self._end_reasoning()
        sys.stdout.write("\n")
        sys.stdout.flush()

    def _end_reasoning(self) -> None:
        if self._in_reasoning:
            sys.stderr.write((NORMAL if self._dim else "") + "\n")
            sys.stderr.flush()
            self._in_reasoning = False


class ReplyText:
    """A streamed reply's answer and reasoning, fed each round's text delta; `end()` once."""

    def __init__(self, harmony: bool, echo: ReplyEcho | None = None):
        self._splitter = HarmonySplitter({}) if harmony else None
        self._echo = echo
        self._answer: list[str] = []
        self._reasoning: list[str] = []

    def add(self, text: str) -> None:
        if self._splitter is None:
            self._keep(text, "")
        else:
            self._keep(self._splitter.feed(text)[0], self._splitter.take_reasoning())

    def end(self) -> Reply:
        """What the splitter held goes out; the whole reply."""
        if self._splitter is not None:
            self._keep(self._splitter.finish()[0], self._splitter.take_reasoning())
        if self._echo is not None:
            self._echo.close()
        reasoning = "".join(self._reasoning) if self._splitter is not None else None
        return Reply("".join(self._answer), reasoning)

    def _keep(self, answer: str, reasoning: str) -> None:
        self._answer.append(answer)
        self._reasoning.append(reasoning)
        if self._echo is not None:
            self._echo.write(answer, reasoning)
