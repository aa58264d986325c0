"""The chat screen's view of the drafter's adaptation: the status bar's and the speed panel's
words, kept current by asking `/dflash/status` again after each reply and, while the service is
training or has replies waiting for it, every few seconds; and Alt+A, the drafter screen."""

from __future__ import annotations

from dflash_chat.adapt_view import AdaptState, adapt_sentence, adapt_short
from dflash_chat.widgets.conversation import Conversation
from dflash_chat.widgets.speed_panel import SpeedPanel
from dflash_chat.widgets.status_bar import StatusBar

POLL_EVERY_S = 3.0  # while the drafter catches up: "learning..." ends within this of its end


class AdaptWatch:
    """Mixed into ChatScreen; `watch_adapt_state` runs from its on_mount."""

    _adapt_recheck = False  # a reply ended: its recording can land after the first ask

    def watch_adapt_state(self) -> None:
        self.watch(self.app, "adapt", self._show_adapt)
        self.set_interval(POLL_EVERY_S, self._poll_adapt)

    def _show_adapt(self, state: AdaptState) -> None:
        self.query_one(StatusBar).adapt = adapt_short(state)
        self.query_one(SpeedPanel).adapt = adapt_sentence(state)

    def _poll_adapt(self) -> None:
        wanted = self.app.adapt.catching_up or self._adapt_recheck
        self._adapt_recheck = False
        if wanted and self.app.service_ready.is_set():
            self.app.refresh_status()

    def on_conversation_reply_finished(self, message: Conversation.ReplyFinished) -> None:
        """A finished reply is recorded (or starts the training): the counts change. The
        service records it after its last chunk, so the next tick asks once more."""
        if self.app.adapt.enabled and self.app.service_ready.is_set():
            self.app.refresh_status()
            self._adapt_recheck = True

    def action_drafter(self) -> None:
        from dflash_chat.screens.drafter import DrafterScreen

        if not isinstance(self.app.screen, DrafterScreen):
            self.app.push_screen(DrafterScreen())
