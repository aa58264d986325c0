"""The prompt: several lines. Enter sends; Shift+Enter, Alt+Enter (where the terminal reports
them) and Ctrl+J start a new line; a paste arrives whole, newlines kept. Up on the first line
and Down on the last walk the user's earlier prompts.

A terminal without bracketed paste (or a tmux `paste-buffer` without -p) types a paste's line
breaks as Enter keys: Enter therefore sends only once ENTER_SETTLE_S has passed with no other
key; a key that follows sooner makes that Enter a line break of the paste.

The prompt is cleared only when the screen accepts it (`accept`): a prompt refused while a
reply streams stays where it was typed.
"""

from __future__ import annotations

from typing import ClassVar

from textual import events
from textual.binding import Binding, BindingType
from textual.message import Message
from textual.timer import Timer
from textual.widgets import TextArea

from dflash_chat.widgets import widget_css

NEWLINE_KEYS = frozenset({"shift+enter", "alt+enter", "ctrl+j", "shift+\r", "\r"})
# the app's own keys win over TextArea's (F6 settings, F7 rename, Ctrl+Y copy, Ctrl+E
# editor), and Up/Down walk the history from the first / last line
APP_KEYS = frozenset({"f6", "f7", "ctrl+y,super+y", "end,ctrl+e", "up", "down"})
ENTER_SETTLE_S = 0.05  # far below a person's next key, far above a paste's next character
PLACEHOLDER = "Ask something. Enter sends, Ctrl+J new line, Up: history, Ctrl+P: every action"


class PromptInput(TextArea, inherit_bindings=False):
    DEFAULT_CSS = widget_css(__file__)
    BINDINGS: ClassVar[list[BindingType]] = [
        *(b for b in TextArea.BINDINGS if isinstance(b, Binding) and b.key not in APP_KEYS),
        Binding("end", "cursor_line_end", "Line end", show=False),
        Binding("up", "history(-1)", "Earlier prompt", show=False),
        Binding("down", "history(1)", "Later prompt", show=False),
    ]

    class Send(Message):
        def __init__(self, text: str):
            super().__init__()
            self.text = text

    def __init__(self, history: list[str] | None = None, **kwargs):
        super().__init__(placeholder=PLACEHOLDER, soft_wrap=True, tab_behavior="focus",
                         show_line_numbers=False, highlight_cursor_line=False, **kwargs)
        self.prompts = list(history or [])
        self._position = len(self.prompts)  # len = the prompt being typed
        self._draft = ""
        self._send_timer: Timer | None = None  # an Enter waiting to see whether a paste follows

    @property
    def value(self) -> str:
        return self.text

    @value.setter
    def value(self, text: str) -> None:
        self.load_text(text)
        self.move_cursor(self.document.end)

    def _send(self) -> None:
        self._send_timer = None
        if self.text.strip():
            self.post_message(self.Send(self.text.strip()))

    def remember(self, text: str) -> None:
        if not self.prompts or self.prompts[-1] != text:
            self.prompts.append(text)
        self._position = len(self.prompts)

    def accept(self) -> None:
        """The screen took the prompt: remember it and clear the field."""
        self.remember(self.text.strip())
        self.value = ""
        self._draft = ""

    def action_history(self, step: int) -> None:
        row = self.cursor_location[0]
        at_edge = row == 0 if step < 0 else row == self.document.line_count - 1
        if not at_edge or not self.prompts:
            self.action_cursor_up() if step < 0 else self.action_cursor_down()
            return
        if self._position == len(self.prompts):
            self._draft = self.text
        self._position = max(0, min(len(self.prompts), self._position + step))
        self.value = self._draft if self._position == len(self.prompts) else self.prompts[
            self._position]

    def undo(self) -> None:
        # TextArea resizes before it moves the cursor back: a cursor left below what the undo
        # removes (the end of a long paste) would be looked up there, a crash
        self.move_cursor(self.document.start)
        super().undo()

    async def _on_key(self, event: events.Key) -> None:
        if self._send_timer is not None:  # the Enter before this key was a pasted line break
            self._send_timer.stop()
            self._send_timer = None
            self.insert("\n")
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self._send_timer = self.set_timer(ENTER_SETTLE_S, self._send)
            return
        if event.key.startswith("alt+") and event.key not in NEWLINE_KEYS:
            # a terminal sends Alt+P as ESC p, which arrives with "p" as its character: left to
            # TextArea it would type the letter, and the app's Alt keys never reach their action
            event.prevent_default()
            return
        if event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        await super()._on_key(event)
