"""The open chat's messages, and the reply being generated.

A worker streams the reply from the service and posts batches of chunks; the handlers here own
the state: they grow the MessageView, the live stats, and write the reply to storage as it
grows (at most every SAVE_EVERY_S) and when it ends. Cancelling the worker (Esc) closes the
HTTP stream, which stops the generation in the service; the partial reply is kept.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from textual import work
from textual.containers import VerticalScroll
from textual.message import Message
from textual.reactive import var
from textual.worker import Worker

from dflash_chat.context_fit import with_summary
from dflash_chat.protocol import ServiceError, StreamChunk, StreamUsage
from dflash_chat.stats import LiveStats, SpeedSnapshot
from dflash_chat.storage import HEAD, ChatStore, StoreError
from dflash_chat.storage import Message as StoredMessage
from dflash_chat.widgets import widget_css
from dflash_chat.widgets.message import MessageView, describe

log = logging.getLogger("dflash_chat")
POST_EVERY_S = 1 / 30  # the worker batches chunks: at most ~30 UI updates a second
SAVE_EVERY_S = 0.25  # a streaming reply is written at least this often


@dataclass
class Reply:
    message_id: int
    view: MessageView
    stats: LiveStats
    meta: dict
    saved_at: float = 0.0
    save_failed: bool = False  # a save was refused: said once


class Conversation(VerticalScroll):
    DEFAULT_CSS = widget_css(__file__)

    generating: var[bool] = var(False)

    class Speed(Message):
        """New figures for the speed panel, about the reply being generated."""

        def __init__(self, snapshot: SpeedSnapshot):
            super().__init__()
            self.snapshot = snapshot

    class RequestSent(Message):
        def __init__(self, message_id: int, at: float):
            super().__init__()
            self.message_id = message_id
            self.at = at

    class ReplyFinished(Message):
        def __init__(self, message_id: int, status: str):
            super().__init__()
            self.message_id = message_id
            self.status = status  # done | stopped | error

    class ChunksArrived(Message):
        def __init__(self, message_id: int, chunks: list[StreamChunk]):
            super().__init__()
            self.message_id = message_id
            self.chunks = chunks

    class StreamEnded(Message):
        def __init__(self, message_id: int, status: str, usage: StreamUsage | None,
                     error: str | None):
            super().__init__()
            self.message_id = message_id
            self.status = status
            self.usage = usage
            self.error = error

    def __init__(self, store: ChatStore, **kwargs):
        super().__init__(**kwargs)
        self.store = store
        self.chat_id: int | None = None
        self.show_accepted = False
        self._reply: Reply | None = None
        self._worker: Worker | None = None
        self.following = True  # at the end, or the user scrolled up

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        """Only a scroll moves `following`: a reply's Markdown renders in batches after each
        chunk, so the end can be below the fold without the user having scrolled up."""
        super().watch_scroll_y(old_value, new_value)
        self.following = new_value >= self.max_scroll_y - 1

    # --- what is shown ---

    async def show_chat(self, chat_id: int | None) -> None:
        self.chat_id = chat_id
        await self.remove_children()
        if chat_id is not None:
            views = [MessageView(m, self.show_accepted) for m in self.store.messages(chat_id)]
            await self.mount_all(views)
            self.mark_left_out(self.store.chat(chat_id).context_from)
            self.show_versions()
        self.call_after_refresh(self.scroll_end, animate=False)

    def mark_left_out(self, context_from: int) -> None:
        """The messages the overflow policy leaves out of requests: shown, and marked."""
        for view in self.views():
            view.left_out = view.message_id < context_from

    def views(self) -> list[MessageView]:
        return list(self.query(MessageView))

    def last_view(self, role: str) -> MessageView | None:
        return next((v for v in reversed(self.views()) if v.role == role), None)

    def set_show_accepted(self, show: bool) -> None:
        self.show_accepted = show
        for view in self.views():
            view.show_accepted = show and view.role == "assistant"

    async def forget_from(self, message_id: int) -> None:
        """Take a message and those after it off the screen: a new version replaces them there
        (the store keeps them, a branch of their own)."""
        await self.remove_children([v for v in self.views() if v.message_id >= message_id])

    def show_versions(self) -> None:
        assert self.chat_id is not None
        versions = self.store.versions(self.chat_id)
        for view in self.views():
            view.version = versions.get(view.message_id)

    async def on_message_view_version_requested(self, message: MessageView.VersionRequested) -> None:
        """←/→ on a message with versions: show the branch through the one before or after."""
        if self.generating or self.chat_id is None:
            self.app.notify("A reply is streaming: Esc stops it first", severity="warning")
            return
        versions = self.store.versions_of(message.message_id)
        target = versions[(versions.index(message.message_id) + message.step) % len(versions)]
        self.store.show_version(self.chat_id, target)
        await self.show_chat(self.chat_id)
        self.post_message(self.BranchShown(target))

    class BranchShown(Message):
        """Another version is shown: the screen's panels follow, the view takes the focus."""

        def __init__(self, message_id: int):
            super().__init__()
            self.message_id = message_id

    # --- generating ---

    async def send(self, prompt: str, options: dict, speculative: bool,
                   parent: int | None = HEAD) -> None:
        """Store the prompt (after `parent`: HEAD, the branch shown) and its reply to come
        (StoreError: neither is), then stream it."""
        assert self.chat_id is not None and not self.generating
        user, reply = self.store.add_turn(self.chat_id, prompt,
                                          {"speculative": speculative, "rounds": []}, parent)
        await self.mount(MessageView(user))
        await self._stream_into(reply, options, speculative)

    async def add_prompt(self, prompt: str, parent: int | None = HEAD) -> None:
        """Store the prompt (after `parent`) and show it; its reply comes later (start_reply),
        once what must precede it is done (a summary of the turns left out)."""
        assert self.chat_id is not None and not self.generating
        await self.mount(MessageView(self.store.add_message(self.chat_id, "user", prompt,
                                                            parent=parent)))

    async def start_reply(self, options: dict, speculative: bool,
                          parent: int | None = HEAD) -> None:
        assert self.chat_id is not None and not self.generating
        meta = {"speculative": speculative, "rounds": []}
        stored = self.store.add_message(self.chat_id, "assistant", "", "streaming", meta, parent)
        await self._stream_into(stored, options, speculative)

    async def _stream_into(self, stored: StoredMessage, options: dict, speculative: bool) -> None:
        request = self.request_messages()  # the new reply, still empty, is left out
        meta = stored.meta
        view = MessageView(stored, self.show_accepted)
        waiting = "" if self.app.service_ready.is_set() else " | waiting for the service"
        view.header = f"Assistant | {'speculative' if speculative else 'plain'} | ...{waiting}"
        await self.mount(view)
        self.show_versions()
        view.start_stream()
        self.call_after_refresh(self.scroll_end, animate=False)
        self._reply = Reply(stored.id, view, LiveStats(speculative), meta)
        self.generating = True
        self.post_message(self.Speed(self._reply.stats.snapshot()))
        self._worker = self._stream_reply(stored.id, request, {**options,
                                                                "speculative": speculative})

    def request_messages(self) -> list[dict]:
        return self.system_messages() + [{"role": m.role, "content": m.content}
                                         for m in self.history()]

    def system_messages(self) -> list[dict]:
        return with_summary(*self.system_and_summary())

    def system_and_summary(self) -> tuple[list[dict], str]:
        """The chat's system prompt as messages, and the summary sent after it (summarise)."""
        if self.chat_id is None:
            return [], ""
        chat = self.store.chat(self.chat_id)
        system = [{"role": "system", "content": chat.system_prompt}] if chat.system_prompt else []
        return system, chat.context_summary

    def history(self, before: int | None = None) -> list[StoredMessage]:
        """What a request sends of the chat (`before`: only messages older than that id): its
        messages with text, none that failed, none the overflow policy left out."""
        if self.chat_id is None:
            return []
        start = self.store.chat(self.chat_id).context_from
        return [m for m in self.store.messages(self.chat_id)
                if m.content and m.status != "error" and m.id >= start
                and (before is None or m.id < before)]

    def stop(self) -> bool:
        if self._worker is None or not self.generating:
            return False
        self._worker.cancel()
        return True

    @work(exclusive=True, group="reply")
    async def _stream_reply(self, message_id: int, messages: list[dict], options: dict) -> None:
        app = self.app
        status, usage, error = "stopped", None, None
        pending: list[StreamChunk] = []
        posted_at = 0.0
        try:
            await app.service_ready.wait()
            self.post_message(self.RequestSent(message_id, time.monotonic()))
            async for item in app.client.stream_chat(messages, **options):
                if isinstance(item, StreamUsage):
                    usage = item
                    continue
                pending.append(item)
                if item.received_at - posted_at >= POST_EVERY_S:
                    self.post_message(self.ChunksArrived(message_id, pending))
                    pending, posted_at = [], item.received_at
            status = "done"
        except ServiceError as exc:
            status, error = "error", exc.message
        except Exception as exc:  # the worker's edge: the reply shows the bug
            log.exception("reply %s failed", message_id)
            status, error = "error", f"{type(exc).__name__}: {exc}"
        finally:  # also on cancel (Esc): what arrived is shown and kept
            if pending:
                self.post_message(self.ChunksArrived(message_id, pending))
            self.post_message(self.StreamEnded(message_id, status, usage, error))

    def on_conversation_request_sent(self, message: RequestSent) -> None:
        if self._reply is not None and self._reply.message_id == message.message_id:
            self._reply.stats.sent_at = message.at

    async def on_conversation_chunks_arrived(self, message: ChunksArrived) -> None:
        reply = self._reply
        if reply is None or reply.message_id != message.message_id:
            return
        if reply.stats.tokens == 0:
            mode = "speculative" if reply.stats.speculative else "plain"
            reply.view.header = f"Assistant | {mode} | streaming (Esc stops)"
        for chunk in message.chunks:
            reply.stats.add(chunk)
        rounds = [[len(c.text), c.accepted, len(c.token_ids), c.accepted_chars, c.copied_chars]
                  for c in message.chunks]
        reply.meta["rounds"].extend(rounds)
        reasoning = "".join(c.reasoning for c in message.chunks)
        if reasoning:  # kept with the message, never sent back (the service wants content)
            reply.meta["reasoning"] = reply.meta.get("reasoning", "") + reasoning
            await reply.view.append_reasoning(reasoning)
        await reply.view.append("".join(c.text for c in message.chunks), rounds)
        if self.following:
            self.call_after_refresh(self.scroll_end, animate=False)
        self.post_message(self.Speed(reply.stats.snapshot()))
        if time.monotonic() - reply.saved_at >= SAVE_EVERY_S:
            self._save(reply, "streaming")

    async def on_conversation_stream_ended(self, message: StreamEnded) -> None:
        reply = self._reply
        if reply is None or reply.message_id != message.message_id:
            return
        if message.usage is not None:
            reply.stats.finish({**message.usage.dflash,
                                "prompt_tokens": message.usage.prompt_tokens,
                                "cached_tokens": message.usage.cached_tokens})
        if reply.stats.tokens:
            if reply.stats.final is None:  # stopped: the figures it had (no service totals)
                reply.stats.finish(reply.stats.totals())
            reply.meta["stats"] = reply.stats.totals()  # finish_reason included
        if message.error:
            reply.meta["error"] = message.error
        await reply.view.finish_stream()
        self._save(reply, message.status)
        reply.view.meta = reply.meta
        reply.view.header = describe(self.store.message(reply.message_id))
        self._reply, self._worker = None, None
        self.generating = False
        if self.following:  # the final render can add lines below the fold
            self.call_after_refresh(self.scroll_end, animate=False)
        self.post_message(self.Speed(reply.stats.snapshot() if reply.stats.tokens
                                     else SpeedSnapshot()))
        self.post_message(self.ReplyFinished(reply.message_id, message.status))

    def _save(self, reply: Reply, status: str) -> None:
        """A refused write (a full disk) is said once per reply; the reply keeps streaming and
        the next save tries again."""
        reply.saved_at = time.monotonic()
        try:
            self.store.update_message(reply.message_id, reply.view.text, status, reply.meta)
        except StoreError as exc:
            if not reply.save_failed:
                self.app.notify(f"The reply could not be saved: {exc}", severity="error",
                                timeout=30)
            reply.save_failed = True

    def on_unmount(self) -> None:
        """The app is closing mid-reply: keep what was shown."""
        if self._reply is not None:
            self._save(self._reply, "stopped")


def last_message(messages: list[StoredMessage], role: str) -> StoredMessage | None:
    return next((m for m in reversed(messages) if m.role == role), None)
