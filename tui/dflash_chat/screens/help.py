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
    """(keys, what it does, action id) for every action, then the fixed keys."""
    rows = [(key_label(effective_keys(spec, keymap)), spec.title, spec.id) for spec in ACTIONS]
    return rows + [(keys, title, "") for keys, title in FIXED_KEYS]


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
            table.add_columns("Keys", "Action", "Id (settings.toml \\[keymap])")
            table.add_rows(help_rows(self.keymap))
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
