"""One lane of the race: its reply streaming in, and its figures below. A reasoning model's
reasoning shows above the answer as in the chat (reasoning.py)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.reactive import reactive
from textual.widgets import Markdown, Static
from textual.widgets.markdown import MarkdownStream

from dflash_chat.stats import SpeedSnapshot
from dflash_chat.widgets import widget_css
from dflash_chat.widgets.reasoning import collapse_reasoning, reasoning_block_in, show_reasoning


def lane_figures(snap: SpeedSnapshot) -> str:
    figures = [f"{snap.tokens} tokens", f"{snap.tokens_per_s:.1f} tok/s"]
    if snap.speculative:
        figures.append(f"tau {snap.tau:.2f}")
        figures.append(f"accepted {snap.accepted}/{snap.reachable}")
    return " | ".join(figures) + (" (final)" if snap.final else "")


class RaceLane(Vertical):
    DEFAULT_CSS = widget_css(__file__)

    snapshot: reactive[SpeedSnapshot | None] = reactive(None, always_update=True)

    def __init__(self, title: str, **kwargs):
        super().__init__(**kwargs)
        self.title = title
        self.text = ""  # the answer so far
        self.reasoning = ""
        self._stream: MarkdownStream | None = None

    def compose(self) -> ComposeResult:
        yield Static(self.title, classes="title")
        with VerticalScroll():
            yield Markdown("", classes="body")
        yield Static("waiting", classes="figures")

    async def reset(self) -> None:
        await self.finish()
        self.text = self.reasoning = ""
        block = reasoning_block_in(self)
        if block is not None:
            await block.remove()
        await self.query_one(".body", Markdown).update("")
        self.snapshot = None
        self._stream = Markdown.get_stream(self.query_one(".body", Markdown))

    async def append(self, text: str, reasoning: str = "") -> None:
        """More of the reply: its reasoning (which comes before the answer) and its answer."""
        if self._stream is None:
            return
        scroll = self.query_one(VerticalScroll)
        following = scroll.scroll_y >= scroll.max_scroll_y - 1
        body = self.query_one(".body", Markdown)
        if reasoning:
            self.reasoning += reasoning
            await show_reasoning(scroll, self.reasoning, before=body, answer_begun=bool(self.text))
        if text:
            if not self.text:  # the answer begins: the reasoning steps aside
                collapse_reasoning(self)
            self.text += text
            await self._stream.write(text)
        if following:
            scroll.call_after_refresh(scroll.scroll_end, animate=False)

    async def finish(self) -> None:
        collapse_reasoning(self)
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None

    def watch_snapshot(self, snap: SpeedSnapshot | None) -> None:
        if self.is_mounted:
            self.query_one(".figures", Static).update("waiting" if snap is None
                                                      else lane_figures(snap))
