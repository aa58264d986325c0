"""Settings: the user's defaults (sampling, thinking, theme, the system prompt for new chats)
and the keymap. A chat keeps its own sampling values; what is changed here applies to it too.
Saved to settings.toml only when every field is valid; the problems are listed otherwise, above
the form where they are seen. The first field has the focus when the screen opens."""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.widgets import Button, Footer, Input, Label, Select, Static, Switch

from dflash_chat.actions import ACTIONS
from dflash_chat.settings import OVERFLOW_POLICIES, THINKING_MODES, Settings

NUMBERS = (  # field, label, type
    ("temperature", "Temperature (0 = greedy)", float),
    ("top_p", "Top-p", float),
    ("max_tokens", "Max tokens per reply", int),
    ("seed", "Seed (-1 = none)", int),
    ("block_size", "Block size (0 = the pair's default)", int),
    ("draft_window", "Draft window, context rows (0 = the pair's default)", int),
    ("keep_turns", "Turns kept when the context is full (keep the last turns)", int),
)
OVERFLOW_LABELS = {"drop_oldest": "drop the oldest turns",
                   "keep_last": "keep the system prompt and the last turns",
                   "refuse": "refuse the message",
                   "summarise": "summarise the oldest turns"}
SWITCHES = (
    ("speculative", "Speculative decoding (F2 flips it for the open chat)"),
    ("show_accepted", "Colour accepted drafts: the drafter's, copies (F3)"),
)


def settings_from_form(base: Settings, numbers: dict[str, str], switches: dict[str, bool],
                       choices: dict[str, str], keys: dict[str, str],
                       system_prompt: str) -> tuple[Settings | None, list[str]]:
    """New settings from the form's raw values, or None and the problems."""
    problems, values = [], {}
    for name, label, kind in NUMBERS:
        try:
            values[name] = kind(numbers[name].strip())
        except ValueError:
            problems.append(f"{label}: {numbers[name]!r} is not a {kind.__name__}")
    keymap = {spec.id: keys[spec.id].strip() for spec in ACTIONS
              if keys.get(spec.id, spec.keys).strip() != spec.keys}
    if problems:
        return None, problems
    settings = replace(base, **values, **switches, **choices, keymap=keymap,
                       system_prompt=system_prompt)
    problems = settings.problems()
    return (None, problems) if problems else (settings, [])


class SettingsScreen(Screen):
    CSS_PATH = "settings.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "app.pop_screen", "Cancel"),
                                             Binding("ctrl+s", "save", "Save")]
    AUTO_FOCUS = "#num-temperature"

    def compose(self) -> ComposeResult:
        settings: Settings = self.app.defaults  # the user's, not the open chat's own values
        yield Static(id="problems", markup=False)
        with VerticalScroll(id="form"):
            yield Static("Your defaults, for new chats. A chat keeps its own (F2, Ctrl+T change "
                         "the open chat's); a change saved here applies to it too.", classes="note")
            yield Label("Sampling", classes="section")
            for name, label, _ in NUMBERS:
                with Horizontal(classes="row"):
                    yield Label(label)
                    yield Input(str(getattr(settings, name)), id=f"num-{name}")
            yield Label("Modes", classes="section")
            for name, label in SWITCHES:
                with Horizontal(classes="row"):
                    yield Label(label)
                    yield Switch(getattr(settings, name), id=f"sw-{name}")
            with Horizontal(classes="row"):
                yield Label("Thinking")
                yield Select([(m, m) for m in THINKING_MODES], value=settings.thinking,
                             allow_blank=False, id="sel-thinking")
            with Horizontal(classes="row"):
                yield Label("When a chat fills the context (Alt+O: the open chat's)")
                yield Select([(OVERFLOW_LABELS[p], p) for p in OVERFLOW_POLICIES],
                             value=settings.overflow, allow_blank=False, id="sel-overflow")
            with Horizontal(classes="row"):
                yield Label("Theme")
                themes = sorted(self.app.available_themes)
                yield Select([(t, t) for t in themes], value=settings.theme, allow_blank=False,
                             id="sel-theme")
            with Horizontal(classes="row"):
                yield Label("System prompt for new chats")
                yield Input(settings.system_prompt, id="system-prompt")
            yield Label("Keys (comma separated, Textual key names)", classes="section")
            for spec in ACTIONS:
                with Horizontal(classes="row"):
                    yield Label(spec.title)
                    yield Input(settings.keymap.get(spec.id, spec.keys), placeholder=spec.keys,
                                id=f"key-{spec.id}")
            with Horizontal(id="buttons"):
                yield Button("Save (Ctrl+S)", variant="primary", id="save")
                yield Button("Cancel (Esc)", id="cancel")
        yield Footer()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()
        else:
            self.app.pop_screen()

    def action_save(self) -> None:
        settings, problems = settings_from_form(
            self.app.defaults,
            numbers={name: self.query_one(f"#num-{name}", Input).value for name, _, _ in NUMBERS},
            switches={name: self.query_one(f"#sw-{name}", Switch).value for name, _ in SWITCHES},
            choices={"thinking": self.query_one("#sel-thinking", Select).value,
                     "overflow": self.query_one("#sel-overflow", Select).value,
                     "theme": self.query_one("#sel-theme", Select).value},
            keys={spec.id: self.query_one(f"#key-{spec.id}", Input).value for spec in ACTIONS},
            system_prompt=self.query_one("#system-prompt", Input).value)
        if settings is None:
            self.query_one("#problems", Static).update("Not saved:\n" + "\n".join(problems))
            self.query_one("#problems").display = True
            self.notify("\n".join(problems), title="Not saved", severity="error")
            return
        if settings == self.app.defaults:
            self.notify("Nothing changed: nothing to save")
        else:
            self.app.save_defaults(settings)
            self.notify("Settings saved")
        self.app.pop_screen()
