"""Alt+A: the drafter's adaptation: what it learnt from, τ over time (a sparkline of each
version's τ on the recent held-out replies, then the versions as a table), and whether replies
are recorded. It shows the app's `adapt` state and follows it while open."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Sparkline, Static

from dflash_chat.adapt_view import AdaptState, adapt_sentence, history_lines

NOT_ADAPTING = ("This service does not adapt its drafter: recording is off (Settings, F6), "
                "the pair is served by another engine, or the service predates adaptation.")


def counts_text(state: AdaptState) -> str:
    serving = f"adapted v{state.version}" if state.version is not None else "the shipped drafter"
    recording = "on" if state.recording else "paused"
    return (f"serving: {serving}\nrecording: {recording} ({state.replies} replies, "
            f"{state.pending} not yet trained on)")


class DrafterScreen(Screen):
    CSS_PATH = "drafter.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,q", "app.pop_screen", "Close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="drafter"):
            yield Static("The drafter learns your replies", classes="title")
            yield Static(id="adapt-state", markup=False)
            yield Static("tau on your recent chats, version by version", classes="title history")
            yield Sparkline([], id="adapt-tau", classes="history")
            yield Static(id="adapt-history", classes="history", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        self.watch(self.app, "adapt", self._show)

    def _show(self, state: AdaptState) -> None:
        words = (f"{adapt_sentence(state)}\n{counts_text(state)}" if state.enabled
                 else NOT_ADAPTING)
        self.query_one("#adapt-state", Static).update(words)
        self.query(".history").set(display=bool(state.history))
        if state.history:
            first = state.history[0].tau_before  # the shipped drafter's, the curve's start
            self.query_one("#adapt-tau", Sparkline).data = [
                first, *(entry.tau_after for entry in state.history)]
            self.query_one("#adapt-history", Static).update("\n".join(history_lines(state)))
