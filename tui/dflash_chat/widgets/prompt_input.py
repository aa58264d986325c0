"""The prompt line: Enter sends, Up/Down walk the user's earlier prompts."""

from __future__ import annotations

from typing import ClassVar

from textual.binding import Binding, BindingType
from textual.message import Message
from textual.widgets import Input

from dflash_chat.widgets import widget_css


class PromptInput(Input):
    DEFAULT_CSS = widget_css(__file__)
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up", "history(-1)", "Earlier prompt", show=False),
        Binding("down", "history(1)", "Later prompt", show=False),
    ]

    class Send(Message):
        def __init__(self, text: str):
            super().__init__()
            self.text = text

    def __init__(self, history: list[str] | None = None, **kwargs):
        super().__init__(placeholder="Ask something. Enter sends, Up: history, F1: keys",
                         **kwargs)
        self.history = list(history or [])
        self._position = len(self.history)  # len = the line being typed
        self._draft = ""

    def remember(self, text: str) -> None:
        if not self.history or self.history[-1] != text:
            self.history.append(text)
        self._position = len(self.history)

    def action_history(self, step: int) -> None:
        if not self.history:
            return
        if self._position == len(self.history):
            self._draft = self.value
        self._position = max(0, min(len(self.history), self._position + step))
        self.value = self._draft if self._position == len(self.history) else self.history[
            self._position]
        self.cursor_position = len(self.value)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        text = event.value.strip()
        if not text:
            return
        self.remember(text)
        self.value = ""
        self._draft = ""
        self.post_message(self.Send(text))
