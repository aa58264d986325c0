"""One chat message: the user's prompt as literal text (as typed or pasted), a reply as
Markdown. A reply streams into its Markdown through `Markdown.get_stream()` (one widget update
per batch, never per token). The Markdown is always rendered; with colouring on,
the drafter's accepted tokens have a green tint on the rendered text and tokens a prompt-lookup
draft brought an amber one (draft_colours.py), painted whenever the Markdown finishes a full
render or highlights a code block again and, while a reply streams, every PAINT_EVERY_S over
what the stream has rendered so far.

The service sends one text delta per round, with how many of its characters the accepted
drafts made (and of those, a prompt-lookup draft); from other servers the split between the
drafts and the target's own token is estimated by the token counts.

A reasoning model's reasoning (a harmony target's analysis channel) streams into a dimmed
"Reasoning" block above the answer (reasoning.py); the reply's end collapses it too.
"""

from __future__ import annotations

import re
from typing import ClassVar
from weakref import WeakKeyDictionary

from markdown_it import MarkdownIt
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.message import Message
from textual.reactive import reactive
from textual.timer import Timer
from textual.widgets import Markdown, Static
from textual.widgets.markdown import MarkdownStream

from dflash_chat.storage import Message as StoredMessage
from dflash_chat.widgets import widget_css
from dflash_chat.widgets.draft_colours import PaintedFence, PaintedMarkdown, colour_markdown
from dflash_chat.widgets.reasoning import (
    ReasoningBlock,
    collapse_reasoning,
    reasoning_block_in,
    show_reasoning,
)

__all__ = ["MessageView", "code_blocks", "describe"]
LEFT_OUT = "left out of the context (kept here)"
PAINT_EVERY_S = 0.2  # a streaming reply's colours catch up this often
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>[^\n]*)$")


def code_blocks(text: str) -> list[str]:
    """The fenced code blocks of a Markdown text, in order (``` or ~~~, indented in a list too);
    a fence left open, as in a reply cut by max tokens or Esc, runs to the end of the text."""
    blocks: list[str] = []
    fence, indent, lines = "", 0, []
    for line in text.splitlines(keepends=True):
        if not fence:
            opening = FENCE.match(line.rstrip("\n"))
            if opening and not (opening["fence"][0] == "`" and "`" in opening["info"]):
                fence, indent, lines = opening["fence"], len(opening["indent"]), []
        elif _closes(line, fence):
            blocks.append("".join(lines))
            fence = ""
        else:  # a fence indented in a list: its lines lose that indentation
            lines.append(line[min(indent, len(line) - len(line.lstrip(" "))):])
    if fence and lines:
        blocks.append("".join(lines))
    return blocks


def _closes(line: str, fence: str) -> bool:
    """A closing fence: the opening's character, at least as many, nothing else on the line."""
    mark = line.strip()
    return len(mark) >= len(fence) and mark == fence[0] * len(mark)


def line_break_parser() -> MarkdownIt:
    """Textual's "gfm-like" parser with each newline a line break: a pasted prompt, a poem or a
    list written without blank lines shows its lines as they were written."""
    parser = MarkdownIt("gfm-like")
    parser.core.ruler.push("newlines_break", _soft_breaks_to_hard)
    return parser


def _soft_breaks_to_hard(state) -> None:
    for token in state.tokens:
        for child in token.children or ():
            if child.type == "softbreak":
                child.type = "hardbreak"


class MessageView(Vertical, can_focus=True):
    DEFAULT_CSS = widget_css(__file__)

    show_accepted: reactive[bool] = reactive(False)
    header: reactive[str] = reactive("")
    left_out: reactive[bool] = reactive(False)  # the overflow policy leaves it out of requests
    version: reactive[tuple[int, int] | None] = reactive(None)  # (which, of how many versions)
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("left", "version(-1)", "Earlier version", show=False),
        Binding("right", "version(1)", "Later version", show=False),
    ]

    class VersionRequested(Message):
        def __init__(self, message_id: int, step: int):
            super().__init__()
            self.message_id = message_id
            self.step = step

    def __init__(self, message: StoredMessage, show_accepted: bool = False):
        super().__init__(classes=f"-{message.role}")
        self.message_id = message.id
        self.role = message.role
        self.text = message.content
        self.reasoning: str = message.meta.get("reasoning", "")
        self.meta = message.meta
        self.rounds: list[list[int]] = [list(r) for r in message.meta.get("rounds", [])]
        self._stream: MarkdownStream | None = None
        self._painter: Timer | None = None  # repaints a streaming reply's colours
        self._painted: WeakKeyDictionary = WeakKeyDictionary()  # block -> the content it got
        self.set_reactive(MessageView.show_accepted, show_accepted and self.role == "assistant")
        self.set_reactive(MessageView.header, describe(message))

    def compose(self) -> ComposeResult:
        yield Static(self._header_text(), classes="header", markup=False)
        if self.reasoning:
            yield ReasoningBlock(self.reasoning, collapsed=True)
        if self.role == "user":  # the user's words as written: code keeps its indentation
            yield Static(self.text, classes="prompt-text", markup=False)
        else:
            yield PaintedMarkdown(self.text, classes="body", parser_factory=line_break_parser)

    @property
    def body(self) -> Markdown:
        """A reply's rendered Markdown (a prompt is literal text, never Markdown)."""
        return self.query_one(".body", Markdown)

    @property
    def reasoning_view(self) -> ReasoningBlock | None:
        """The "Reasoning" block, None while the reply has no reasoning."""
        return reasoning_block_in(self)

    def _header_text(self) -> str:
        version = f" | ‹ version {self.version[0]}/{self.version[1]} › (←/→)" if self.version else ""
        return self.header + version + (f" | {LEFT_OUT}" if self.left_out else "")

    def watch_version(self) -> None:
        self.watch_header()

    def action_version(self, step: int) -> None:
        if self.version is not None:
            self.post_message(self.VersionRequested(self.message_id, step))

    def watch_header(self) -> None:
        if self.is_mounted:
            self.query_one(".header", Static).update(self._header_text())

    def watch_left_out(self, left_out: bool) -> None:
        self.set_class(left_out, "-left-out")
        self.watch_header()

    async def watch_show_accepted(self, show: bool) -> None:
        if not self.is_mounted or self._stream is not None:
            return  # a streaming reply's painter reads the flag itself
        if show:
            colour_markdown(self.body, self.text, self.rounds, self._painted)
        else:  # a fresh render drops the colours
            await self.body.update(self.text)

    def on_markdown_table_of_contents_updated(self, event: Markdown.TableOfContentsUpdated) -> None:
        """Posted after every full render: paint it (a streaming reply has its painter)."""
        event.stop()
        if self.show_accepted and self._stream is None:
            colour_markdown(self.body, self.text, self.rounds, self._painted)

    def on_painted_fence_rehighlighted(self, event: PaintedFence.Rehighlighted) -> None:
        """A code block highlighted again (a theme change) lost its colours: paint it again
        (the other blocks still show theirs and are skipped)."""
        event.stop()
        if self.show_accepted and self._stream is None:  # a streaming reply has its painter
            colour_markdown(self.body, self.text, self.rounds, self._painted)

    # --- streaming ---

    def start_stream(self) -> None:
        self._stream = Markdown.get_stream(self.body)
        self._painter = self.set_interval(PAINT_EVERY_S, self._paint_stream)

    def _paint_stream(self) -> None:
        """The stream renders in batches behind `self.text`: paint what it has rendered (the
        final full render, when the reply ends, paints every block again)."""
        if self.show_accepted:
            colour_markdown(self.body, self.text, self.rounds, self._painted)

    async def append_reasoning(self, text: str) -> None:
        """More reasoning: the block appears (open, unless the answer has begun) and grows."""
        self.reasoning += text
        await show_reasoning(self, self.reasoning, before=self.body, answer_begun=bool(self.text))

    async def append(self, text: str, rounds: list[list[int]]) -> None:
        if text and not self.text:  # the answer begins: the reasoning steps aside
            collapse_reasoning(self)
        self.text += text
        self.rounds.extend(rounds)
        if self._stream is not None:
            await self._stream.write(text)

    async def finish_stream(self) -> None:
        collapse_reasoning(self)
        if self._painter is not None:
            self._painter.stop()
            self._painter = None
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        if self.show_accepted:  # one full render, which the handler above paints
            await self.body.update(self.text)


def describe(message: StoredMessage) -> str:
    """The header line: who, and for a reply its mode and figures."""
    if message.role == "user":
        return "You"
    meta = message.meta
    parts = ["Assistant", "speculative" if meta.get("speculative", True) else "plain"]
    stats = meta.get("stats") or {}
    if stats:
        if meta.get("speculative", True):
            parts.append(f"tau {stats.get('tau', 0.0):.2f}")
        parts.append(f"{stats.get('decode_tokens_per_s', 0.0):.1f} tok/s")
        if stats.get("cached_tokens"):  # the prefix cache served the prompt's start
            tier = stats.get("cached_tier")
            parts.append(f"{stats['cached_tokens']} cached" + (f" ({tier})" if tier else ""))
        if isinstance(stats.get("drafter_version"), int):  # an adapted drafter served it
            parts.append(f"drafter v{stats['drafter_version']}")
    if stats.get("finish_reason") == "length":
        parts.append("max tokens reached")
    if message.status not in ("done", "streaming"):
        parts.append(message.status + (f": {meta['error']}" if meta.get("error") else ""))
    return " | ".join(parts)
