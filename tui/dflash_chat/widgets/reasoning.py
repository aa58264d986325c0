"""A reasoning model's reasoning (a harmony target's analysis channel) above its answer: a
dimmed "Reasoning" block, open while the reasoning streams and collapsed once the answer begins
(its title toggles it: click, or Enter when focused). A chat reply and a race lane both show it
this way; a reply without reasoning never gets one, so it looks as it always did.
"""

from __future__ import annotations

from textual.css.query import NoMatches
from textual.widget import Widget
from textual.widgets import Collapsible, Static

from dflash_chat.widgets import widget_css

REASONING_TITLE = "Reasoning"


class ReasoningBlock(Collapsible):
    DEFAULT_CSS = widget_css(__file__)

    def __init__(self, text: str, collapsed: bool):
        super().__init__(Static(text, classes="reasoning-text", markup=False),
                         title=REASONING_TITLE, collapsed=collapsed, classes="reasoning")
        self._text, self._update_pending = text, False

    def show(self, text: str) -> None:
        """Show `text` from the next refresh on: the stream's many small pieces between two
        frames cost one re-layout of the whole text, not one each."""
        self._text = text
        if not self._update_pending:
            self._update_pending = True
            self.call_after_refresh(self._update)

    def _update(self) -> None:
        self._update_pending = False
        self.query_one(".reasoning-text", Static).update(self._text)


def reasoning_block_in(container: Widget) -> ReasoningBlock | None:
    try:
        return container.query_one(ReasoningBlock)
    except NoMatches:
        return None


async def show_reasoning(container: Widget, text: str, before: Widget, answer_begun: bool) -> None:
    """Show `text`, the reasoning so far, in container's block: a new one goes just before
    `before` (the answer), open unless the answer has begun."""
    block = reasoning_block_in(container)
    if block is None:
        await container.mount(ReasoningBlock(text, collapsed=answer_begun), before=before)
    else:
        block.show(text)


def collapse_reasoning(container: Widget) -> None:
    block = reasoning_block_in(container)
    if block is not None:
        block.collapsed = True
