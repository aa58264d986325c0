"""One chat message. A reply streams into its Markdown through `Markdown.get_stream()` (one
widget update per batch, never per token); with colouring on, the same text is shown with the
drafter's accepted tokens in green instead, and tokens a prompt-lookup copy brought in cyan.

The service sends one text delta per round, with how many of its characters the accepted
drafts made (and of those, a prompt-lookup copy); from other servers the split between the
drafts and the target's own token is estimated by the token counts.
"""

from __future__ import annotations

import re
import time

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.reactive import reactive
from textual.widgets import Markdown, Static
from textual.widgets.markdown import MarkdownStream

from dflash_chat.storage import Message
from dflash_chat.widgets import widget_css

DRAFT_STYLE = "bold green"
COPY_STYLE = "bold cyan"  # accepted drafts copied from the context (prompt lookup), not drafted
ACCEPTED_REFRESH_S = 0.2
CODE_BLOCK = re.compile(r"```[^\n]*\n(.*?)```", re.DOTALL)


def accepted_text(text: str, rounds: list[list[int]]) -> Text:
    """`text` with the accepted drafts styled; rounds are [chars, accepted, committed] plus,
    from services that say it, the exact count of characters the accepted drafts made and how
    many of those (the last) a prompt-lookup copy made."""
    styled = Text()
    position = 0
    for chars, accepted, committed, *exact in rounds:
        piece = text[position:position + chars]
        position += chars
        if exact and exact[0] is not None:
            split = min(exact[0], len(piece))
        else:  # an older record or another server: share the round's characters by tokens
            split = round(len(piece) * accepted / committed) if committed else 0
        # the copy's characters follow the drafter's; a piece a stop string cut keeps its start
        own = min(exact[0] - (exact[1] or 0), split) if len(exact) > 1 and exact[0] is not None else split
        styled.append(piece[:own], style=DRAFT_STYLE)
        styled.append(piece[own:split], style=COPY_STYLE)
        styled.append(piece[split:])
    styled.append(text[position:])
    return styled


def code_blocks(text: str) -> list[str]:
    return CODE_BLOCK.findall(text)


class MessageView(Vertical, can_focus=True):
    DEFAULT_CSS = widget_css(__file__)

    show_accepted: reactive[bool] = reactive(False)
    header: reactive[str] = reactive("")

    def __init__(self, message: Message, show_accepted: bool = False):
        super().__init__(classes=f"-{message.role}")
        self.message_id = message.id
        self.role = message.role
        self.text = message.content
        self.rounds: list[list[int]] = [list(r) for r in message.meta.get("rounds", [])]
        self._stream: MarkdownStream | None = None
        self._accepted_at = 0.0
        self.set_reactive(MessageView.show_accepted, show_accepted and self.role == "assistant")
        self.set_reactive(MessageView.header, describe(message))

    def compose(self) -> ComposeResult:
        yield Static(self.header, classes="header", markup=False)
        yield Markdown(self.text, classes="body")
        yield Static(classes="accepted")

    def on_mount(self) -> None:
        self._show_mode()

    def watch_header(self, header: str) -> None:
        if self.is_mounted:
            self.query_one(".header", Static).update(header)

    def watch_show_accepted(self) -> None:
        if self.is_mounted:
            self._show_mode()

    def _show_mode(self) -> None:
        self.set_class(self.show_accepted, "-show-accepted")
        if self.show_accepted:
            self.query_one(".accepted", Static).update(accepted_text(self.text, self.rounds))

    # --- streaming ---

    def start_stream(self) -> None:
        self._stream = Markdown.get_stream(self.query_one(".body", Markdown))

    async def append(self, text: str, rounds: list[list[int]]) -> None:
        self.text += text
        self.rounds.extend(rounds)
        if self._stream is not None:
            await self._stream.write(text)
        now = time.monotonic()
        if self.show_accepted and now - self._accepted_at > ACCEPTED_REFRESH_S:
            self._accepted_at = now
            self.query_one(".accepted", Static).update(accepted_text(self.text, self.rounds))

    async def finish_stream(self) -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self._show_mode()


def describe(message: Message) -> str:
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
    if message.status not in ("done", "streaming"):
        parts.append(message.status + (f": {meta['error']}" if meta.get("error") else ""))
    return " | ".join(parts)
