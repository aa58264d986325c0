"""The chat screen's send: a prompt checked against the loaded pair's context under the chat's
overflow policy (context_fit.py), then stored and streamed; and the context meter.

A worker asks the service to count the request (the service's own template and tokenizer) and
posts the fit or the refusal; the handlers store and send, or keep the prompt in its field and
say why. Without a service that counts (not ready yet, or a served engine without a tokenizer)
the prompt is sent as it is and the service's own check answers. Under the summarise policy the
prompt shows first, with a notice, while a worker has the model summarise the turns left out;
the reply starts once the summary is written.
"""

from __future__ import annotations

import logging
from pathlib import Path
from textwrap import shorten

from textual import work
from textual.message import Message

from dflash_chat.attachments import AttachmentError, expand_attachments
from dflash_chat.chat_text import chat_title
from dflash_chat.context_fit import (
    SUMMARY_TOKENS,
    WARN_AT,
    ContextFit,
    ContextOverflow,
    HistoryMessage,
    fit_history,
    policy_words,
    summary_request,
)
from dflash_chat.protocol import ServiceError, StreamChunk
from dflash_chat.stats import SpeedSnapshot
from dflash_chat.storage import HEAD, StoreError
from dflash_chat.widgets.prompt_input import PromptInput
from dflash_chat.widgets.status_bar import StatusBar

log = logging.getLogger("dflash_chat")


class SendFlow:
    """Mixed into ChatScreen (which owns the conversation, the prompt and `_editing`)."""

    _sent_tokens: int | None = None  # the prompt's tokens of the reply streaming now
    _warned_chat: int | None = None  # the chat told that it nears its context
    _summarising: int | None = None  # the chat whose left-out turns are being summarised

    class PromptFitted(Message):
        def __init__(self, text: str, typed: str, fit: ContextFit | None,
                     dropped: tuple[HistoryMessage, ...] = ()):
            super().__init__()
            self.text, self.typed, self.fit = text, typed, fit  # fit None: not counted
            self.dropped = dropped  # the summarise policy: the turns to summarise first

    class SummaryWritten(Message):
        def __init__(self, chat_id: int, fit: ContextFit, summary: str):
            super().__init__()
            self.chat_id, self.fit = chat_id, fit
            self.summary = summary  # what the turns left out said ("": none could be written)

    class PromptRefused(Message):
        def __init__(self, overflow: ContextOverflow):
            super().__init__()
            self.overflow = overflow

    async def on_prompt_input_send(self, message: PromptInput.Send) -> None:
        if self.conversation.generating:  # the prompt stays in the field for after
            self.notify("A reply is streaming: Esc stops it, then Enter sends this",
                        severity="warning")
            return
        if self._summarising is not None:
            self.notify("The earlier turns are being summarised: send this after the reply",
                        severity="warning")
            return
        try:
            text = expand_attachments(message.text, Path.cwd())
        except AttachmentError as exc:
            self.notify(str(exc), title="Not sent", severity="error")
            return
        if self.app.service_ready.is_set() and self.app.loaded_context():
            self._fit_prompt(text, message.text)
        else:
            await self._send(text, message.text, None)

    async def _count(self, messages: list[dict]) -> int:
        """The service's count of a request as this chat would send it."""
        app = self.app
        return await app.client.count_tokens(app.served_model(), messages,
                                             app.settings.sampling().get("thinking"))

    @work(exclusive=True, group="fit")
    async def _fit_prompt(self, text: str, typed: str) -> None:
        app, conversation, settings = self.app, self.conversation, self.app.settings
        history = [HistoryMessage(m.id, m.role, m.content)
                   for m in conversation.history(before=self._editing)]
        system, summary = conversation.system_and_summary()
        try:
            fit = await fit_history(self._count, system, history, text, app.loaded_context(),
                                    settings.max_tokens, settings.overflow, settings.keep_turns,
                                    summary)
        except ContextOverflow as exc:
            self.post_message(self.PromptRefused(exc))
            return
        except ServiceError as exc:  # no count (a served engine): the service's check answers
            log.info("the prompt was not counted: %s", exc.message)
            fit = None
        summarise = fit is not None and settings.overflow == "summarise"
        self.post_message(self.PromptFitted(text, typed, fit,
                                            tuple(history[:fit.dropped]) if summarise else ()))

    def _start_summary(self, fit: ContextFit, dropped: tuple[HistoryMessage, ...]) -> None:
        """Say what the wait is for, then summarise: the reply starts once it is written."""
        chat_id, turns = self.conversation.chat_id, sum(m.role == "user" for m in dropped)
        self._summarising = chat_id
        self.notify(f"Summarising {turns} earlier turns to make room in the context; the "
                    f"reply follows.", title="Context full", timeout=10)
        self._write_summary(chat_id, fit, dropped, self.conversation.system_messages())

    @work(exclusive=True, group="summary")
    async def _write_summary(self, chat_id: int, fit: ContextFit,
                             dropped: tuple[HistoryMessage, ...], system: list[dict]) -> None:
        summary = await self._summarise(system, list(dropped))
        self.post_message(self.SummaryWritten(chat_id, fit, summary))

    async def _summarise(self, system: list[dict], dropped: list[HistoryMessage]) -> str:
        """The model's summary of the turns left out, asked after `system` as last sent (""
        where it could not write one: they are left out all the same)."""
        try:
            request = await summary_request(self._count, system, dropped,
                                            self.app.loaded_context())
            if request is None:
                return ""
            parts = [item.text async for item in self.app.client.stream_chat(
                request, max_tokens=SUMMARY_TOKENS, temperature=0.0)
                if isinstance(item, StreamChunk)]
        except ServiceError as exc:
            log.warning("no summary of the turns left out: %s", exc.message)
            return ""
        return "".join(parts).strip()

    def on_send_flow_prompt_refused(self, message: PromptRefused) -> None:
        self.notify(message.overflow.explain(self.app.keys_of), title="Not sent: it does not fit",
                    severity="error", timeout=30)

    async def on_send_flow_prompt_fitted(self, message: PromptFitted) -> None:
        await self._send(message.text, message.typed, message.fit, message.dropped)

    async def _send(self, text: str, typed: str, fit: ContextFit | None,
                    dropped: tuple[HistoryMessage, ...] = ()) -> None:
        """Store and show the prompt, then stream its reply (`dropped`: after their summary)."""
        conversation, store = self.conversation, self.app.store
        try:
            if conversation.chat_id is None:  # stored with the values it is sent with
                await self._open_new_chat(chat_title(typed))
            else:
                store.set_chat_settings(conversation.chat_id, self.app.chat_settings())
            parent = HEAD
            if self._editing is not None:  # a new version of that prompt: the old one stays
                parent = store.message(self._editing).parent_id
            if fit is not None and fit.first_kept is not None and not dropped:
                store.set_context_from(conversation.chat_id, fit.first_kept)
            settings = self.app.settings
            if self._editing is not None:
                await conversation.forget_from(self._editing)
            if dropped:  # the prompt shows now, its reply after the summary
                await conversation.add_prompt(text, parent)
            else:
                await conversation.send(text, settings.sampling(), settings.speculative, parent)
        except StoreError as exc:  # a full disk: what was typed stays, to send again
            self.notify(f"The chat history could not be written: {exc}. Your prompt is kept.",
                        title="Not sent", severity="error", timeout=30)
            if conversation.chat_id is not None:  # what an edit took off the screen
                await conversation.show_chat(conversation.chat_id)
            self.refresh_chat_list()
            return
        self._editing = None
        self.query_one(PromptInput).accept()
        self.refresh_chat_list()
        if dropped:
            self._start_summary(fit, dropped)
        elif fit is not None:
            self._show_sent(fit)

    async def on_send_flow_summary_written(self, message: SummaryWritten) -> None:
        """The summary goes in place of the turns left out; the reply starts where its chat is
        still shown (elsewhere its prompt waits for a regenerate)."""
        self._summarising = None
        conversation, settings, shown = self.conversation, self.app.settings, False
        try:
            self.app.store.set_context_from(message.chat_id, message.fit.first_kept,
                                            message.summary)
            shown = conversation.chat_id == message.chat_id and not conversation.generating
            if shown:
                await conversation.start_reply(settings.sampling(), settings.speculative)
        except StoreError as exc:
            self.notify(f"The chat history could not be written: {exc}.", title="Not sent",
                        severity="error", timeout=30)
            return
        if shown:
            self._show_sent(message.fit, message.summary)

    def _show_sent(self, fit: ContextFit, summary: str = "") -> None:
        self._sent_tokens = fit.tokens
        self._show_context(fit.tokens)
        if fit.first_kept is not None:
            self._say_left_out(fit, summary)

    def _say_left_out(self, fit: ContextFit, summary: str) -> None:
        self.conversation.mark_left_out(fit.first_kept)
        policy = self.app.settings.overflow.replace("_", " ")
        instead = (f"; the model's summary of them is sent instead "
                   f"({len(summary.split())} words: {shorten(summary, 60, placeholder='…')})"
                   if summary else "")
        self.notify(f"{fit.dropped} earlier messages are left out of the context to make room "
                    f"(overflow policy: {policy}); they stay in the chat, dimmed{instead}.",
                    title="Context full", severity="warning", timeout=15)

    def _show_context(self, tokens: int | None) -> None:
        """The meter; the first time a chat passes WARN_AT, what its overflow policy will do."""
        context = self.app.loaded_context()
        self.query_one(StatusBar).context = (tokens, context) if tokens and context else None
        chat_id = self.conversation.chat_id
        if tokens and context and tokens >= WARN_AT * context and self._warned_chat != chat_id:
            self._warned_chat = chat_id
            words = policy_words(self.app.settings.overflow, self.app.settings.keep_turns)
            self.notify(f"This chat fills {tokens / context:.0%} of the context; when it is full, "
                        f"{words} ({self.app.keys_of('toggle_overflow')}: this chat's policy).",
                        title="Context nearly full", severity="warning", timeout=10)

    def _context_of(self, snapshot: SpeedSnapshot) -> int | None:
        """The conversation's tokens once this reply is in it (live: the prompt as counted)."""
        if snapshot.prompt_tokens is not None:
            return snapshot.prompt_tokens + snapshot.tokens
        if snapshot.live and self._sent_tokens is not None:
            return self._sent_tokens + snapshot.tokens
        return None
