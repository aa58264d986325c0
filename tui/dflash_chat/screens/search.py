"""Search past chats (Ctrl+F): every word typed, as a word prefix, over all messages and the
replies' reasoning (SQLite FTS5); a hit found in the reasoning says so. Enter on a hit opens
its chat."""

from __future__ import annotations

import re
from datetime import datetime
from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label, OptionList
from textual.widgets.option_list import Option

from dflash_chat.storage import SearchHit, StoreError

WHITESPACE = re.compile(r"\s+")  # a snippet's line breaks: one line per hit


def hit_label(hit: SearchHit) -> Text:
    label = Text(hit.chat.title, style="bold")
    label.append(f"  {datetime.fromtimestamp(hit.chat.created):%Y-%m-%d %H:%M}", style="dim")
    label.append("\n")
    if hit.in_reasoning:  # where the chat keeps it collapsed
        label.append("in the reasoning: ", style="italic")
    for text, is_match in hit.parts():  # the words found are highlighted, not bracketed
        label.append(WHITESPACE.sub(" ", text), style="bold reverse" if is_match else "")
    return label


class SearchScreen(ModalScreen[int | None]):
    CSS_PATH = "search.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "dismiss(None)", "Close"),
        Binding("down", "results", "Results", show=False),
    ]

    def compose(self) -> ComposeResult:
        with Vertical(id="search-box"):
            yield Label("Search past chats (every word; Enter on a hit opens it)")
            yield Input(placeholder="words...", id="search-query")
            yield OptionList(id="search-hits")

    def on_input_changed(self, event: Input.Changed) -> None:
        hits = self.app.store.search(event.value)
        results = self.query_one(OptionList)
        results.clear_options()
        results.add_options([Option(hit_label(hit), id=f"{hit.chat.id}:{hit.message_id}")
                             for hit in hits])
        if hits:
            results.highlighted = 0

    def on_input_submitted(self, event: Input.Submitted) -> None:
        results = self.query_one(OptionList)
        if results.option_count:
            self._open(results.get_option_at_index(results.highlighted or 0).id)

    def action_results(self) -> None:
        self.query_one(OptionList).focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self._open(event.option.id)

    def _open(self, option_id: str) -> None:
        """The hit's chat, showing the branch the hit is on."""
        chat_id, message_id = (int(part) for part in option_id.split(":"))
        store = self.app.store
        if message_id not in {message.id for message in store.messages(chat_id)}:
            try:
                store.show_version(chat_id, message_id)
            except StoreError as exc:  # the chat opens on the branch it had
                self.notify(f"The hit's branch could not be shown: {exc}", severity="warning")
        self.dismiss(chat_id)
