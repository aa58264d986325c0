"""The chats, newest first, each as its title (up to two lines) and the day it began. Selecting
one opens it; Delete and R act on the highlighted one."""

from __future__ import annotations

import textwrap
from datetime import datetime
from typing import ClassVar

from rich.text import Text
from textual.binding import Binding, BindingType
from textual.message import Message
from textual.widgets import OptionList
from textual.widgets.option_list import Option

from dflash_chat.storage import Chat
from dflash_chat.widgets import widget_css

TITLE_WIDTH = 20  # the list is 24 cells wide: its border, padding and scrollbar take 4
TITLE_LINES = 2


def title_lines(title: str, width: int = TITLE_WIDTH, lines: int = TITLE_LINES) -> str:
    """The title wrapped at words into at most `lines` lines, cut with "…" when longer."""
    wrapped = textwrap.wrap(" ".join(title.split()), width) or ["untitled"]
    if len(wrapped) > lines:
        last = wrapped[lines - 1]
        wrapped = [*wrapped[:lines - 1], (last if len(last) < width else last[:width - 1]) + "…"]
    return "\n".join(wrapped)


def chat_label(chat: Chat) -> Text:
    label = Text(title_lines(chat.title))
    label.append(f"\n{datetime.fromtimestamp(chat.created):%Y-%m-%d %H:%M}", style="dim")
    return label


class ChatList(OptionList):
    DEFAULT_CSS = widget_css(__file__)
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("delete", "delete", "Delete chat"),
        Binding("r", "rename", "Rename chat"),
    ]

    class ChatSelected(Message):
        def __init__(self, chat_id: int):
            super().__init__()
            self.chat_id = chat_id

    class DeleteRequested(ChatSelected):
        pass

    class RenameRequested(ChatSelected):
        pass

    def show(self, chats: list[Chat], current: int | None) -> None:
        self.clear_options()
        self.add_options([Option(chat_label(chat), id=str(chat.id)) for chat in chats])
        if current is not None:
            ids = [chat.id for chat in chats]
            if current in ids:
                self.highlighted = ids.index(current)

    def _highlighted_id(self) -> int | None:
        if self.highlighted is None:
            return None
        return int(self.get_option_at_index(self.highlighted).id)

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.post_message(self.ChatSelected(int(event.option.id)))

    def action_delete(self) -> None:
        if (chat_id := self._highlighted_id()) is not None:
            self.post_message(self.DeleteRequested(chat_id))

    def action_rename(self) -> None:
        if (chat_id := self._highlighted_id()) is not None:
            self.post_message(self.RenameRequested(chat_id))
