"""Presets (Alt+P): named bundles of a system prompt, a chat's own values (sampling,
speculation, thinking, overflow) and the pair, the user's, kept in the chat store. Enter on one
applies it to the open chat; the first line saves the open chat's values under a name; Delete
removes one."""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList
from textual.widgets.option_list import Option

from dflash_chat.storage import Preset, StoreError

SAVE = "save"  # the option that saves the open chat's values


def preset_label(preset: Preset) -> Text:
    label = Text(preset.name, style="bold")
    values = ", ".join(f"{name} {value}" for name, value in sorted(preset.settings.items()))
    label.append(f"\n{values}", style="dim")
    if preset.system_prompt:
        label.append(f"\nsystem: {' '.join(preset.system_prompt.split())[:70]}", style="dim")
    return label


class PresetScreen(ModalScreen[tuple[str, str] | None]):
    """Dismisses with ("apply", name), ("save", ""), or None (Esc)."""

    CSS_PATH = "presets.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "dismiss(None)", "Close"),
        Binding("delete", "delete", "Delete the preset"),
    ]

    def __init__(self, presets: list[Preset]):
        super().__init__()
        self.presets = presets

    def compose(self) -> ComposeResult:
        with Vertical(id="presets-box"):
            yield Label("Presets: Enter applies one to this chat, Delete removes it, Esc closes")
            options = [Option(Text("+ Save this chat's values as a preset…", style="italic"),
                              id=SAVE)]
            options += [Option(preset_label(p), id=f"preset:{p.name}") for p in self.presets]
            yield OptionList(*options, id="preset-list")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        chosen = event.option.id or ""
        self.dismiss(("save", "") if chosen == SAVE else ("apply", chosen.removeprefix("preset:")))

    def action_delete(self) -> None:
        options = self.query_one(OptionList)
        highlighted = options.highlighted
        if highlighted is None:
            return
        chosen = options.get_option_at_index(highlighted).id or ""
        if chosen.startswith("preset:"):
            name = chosen.removeprefix("preset:")
            try:
                self.app.store.delete_preset(name)
            except StoreError as exc:
                self.notify(f"The preset could not be deleted: {exc}", severity="error")
                return
            options.remove_option(chosen)
            self.notify(f"Preset {name!r} deleted")
