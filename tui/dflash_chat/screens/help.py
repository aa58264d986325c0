"""F1: every key, as the user's keymap has them, grouped by where they work."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Label, Static

from dflash_chat.actions import ACTIONS, FIXED_KEYS, effective_keys, key_label
from dflash_chat.widgets.draft_colours import DRAFT_STYLE, LOOKUP_STYLE


def help_rows(keymap: dict[str, str]) -> list[tuple[str, str, str]]:
    """(keys, action id, what it does) for every action, then the fixed keys; several keys one
    a line, so the id (what settings.toml's [keymap] names) keeps its width at 80 columns."""
    rows = [(key_label(effective_keys(spec, keymap)), spec.id, spec.title) for spec in ACTIONS]
    rows += [(keys, "", title) for keys, title in FIXED_KEYS]
    return [(keys.replace(", ", "\n"), action, title) for keys, action, title in rows]


class HelpScreen(ModalScreen[None]):
    CSS_PATH = "help.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,f1,q", "dismiss", "Close")]

    def __init__(self, keymap: dict[str, str], service_log: Path | None = None):
        super().__init__()
        self.keymap = keymap
        self.service_log = service_log  # the child service's log, when the app started one

    def compose(self) -> ComposeResult:
        with Vertical(id="help"):
            yield Label("dflash-chat keys (change them in Settings, F6)", id="help-title")
            table = DataTable(cursor_type="row", zebra_stripes=True)
            table.add_columns("Keys", "Id (\\[keymap])", "Action")
            for row in help_rows(self.keymap):
                table.add_row(*row, height=None)  # a key a line
            yield table
            yield Static(f"[{DRAFT_STYLE}]Tinted green[/] in a reply (F3): tokens the drafter "
                         f"proposed and the target accepted; [{LOOKUP_STYLE}]amber[/]: accepted "
                         "tokens copied from the context (prompt lookup). tau: tokens committed "
                         "per verify round.", id="help-note")
            if self.service_log is not None:
                yield Static(f"The service's log: {self.service_log}", id="help-log",
                             markup=False)

    async def action_dismiss(self, result=None) -> None:
        self.dismiss(result)
