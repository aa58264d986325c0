"""One line above the footer: the service, the shown reply's speed (live while it streams: the
line that stays when the speed panel steps aside), the loaded pair, and the next message's modes."""

from __future__ import annotations

import time

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from dflash_chat.context_fit import WARN_AT, meter_text
from dflash_chat.protocol import PHASE_CALIBRATING, PHASE_IMPORTING, PHASE_ONCE
from dflash_chat.widgets import widget_css

DOWN_STATES = ("service stopped", "service failed", "error")
FULL_AT = 0.95  # the meter turns red: the next turn overflows the context


class StatusBar(Widget):
    DEFAULT_CSS = widget_css(__file__)

    service: reactive[str] = reactive("starting")
    model: reactive[str] = reactive("")
    speculative: reactive[bool] = reactive(True)
    thinking: reactive[str] = reactive("auto")
    show_accepted: reactive[bool] = reactive(True)
    warning: reactive[str] = reactive("")
    speed: reactive[str] = reactive("")  # compact_speed_text of the reply the panel shows
    context: reactive[tuple[int, int] | None] = reactive(None)  # (the chat's tokens, the pair's)
    busy_since: reactive[float | None] = reactive(None)  # set while the service is not ready

    def on_mount(self) -> None:
        self.set_interval(1.0, self._tick)

    def _tick(self) -> None:
        if self.busy_since is not None:
            self.refresh()

    def watch_service(self, service: str) -> None:
        """A wait's counter starts with it: each phase shows its own time, not the app's."""
        busy = service.startswith(("starting", "loading", PHASE_IMPORTING, PHASE_CALIBRATING))
        self.busy_since = time.monotonic() if busy else None

    def render(self) -> Text:
        """The model steps aside where the line is too narrow for it: the modes the next
        message uses (and a warning) stay in sight at 80 columns."""
        head, modes = self._state_and_figures(), self._modes()
        model = f" {self.model} " if self.model else ""
        if head.cell_len + len(model) + modes.cell_len > self.size.width:
            model = ""
        return Text.assemble(head, model, modes)

    def _state_and_figures(self) -> Text:
        text = Text()
        ready = self.service == "ready"
        state = self.service
        phase = state.split(" ", 1)[0]
        if phase in PHASE_ONCE:
            state += f" ({PHASE_ONCE[phase]})"
        if self.busy_since is not None:
            state += f" {time.monotonic() - self.busy_since:.0f} s"
        down = self.service.startswith(DOWN_STATES)
        style = "reverse green" if ready else "reverse red" if down else "reverse yellow"
        text.append(f" {state} ", style=style)
        if self.speed:
            text.append(f" {self.speed} ", style="bold")
        if self.context is not None:
            tokens, context = self.context
            full = tokens / context
            style = "bold red" if full >= FULL_AT else "bold yellow" if full >= WARN_AT else ""
            text.append(f" {meter_text(tokens, context)} ", style=style)
        return text

    def _modes(self) -> Text:
        text = Text(" | ")
        text.append("SPEC ON" if self.speculative else "SPEC OFF",
                    style="bold green" if self.speculative else "bold red")
        text.append(f" | thinking {self.thinking} | colour {'on' if self.show_accepted else 'off'}")
        if self.warning:
            text.append(f" | {self.warning}", style="bold yellow")
        return text
