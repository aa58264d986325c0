"""The chat screen's chat-wide actions: rename, the system prompt, export, delete and bring
back the chat deleted last (kept in memory until the app closes: messages, branches and the
chat's own values, written again through the store)."""

from __future__ import annotations

from pathlib import Path

from dflash_chat.actions import BY_ID, effective_keys, key_label
from dflash_chat.chat_text import export_markdown
from dflash_chat.screens.dialogs import ConfirmDialog, TextDialog
from dflash_chat.storage import HEAD, ChatStore, StoreError
from dflash_chat.widgets.message import MessageView


class ChatActions:
    """Mixed into ChatScreen (which owns the conversation and the chat list)."""

    _deleted: tuple | None = None  # the chat deleted last: (chat, every message)

    def action_rename_chat(self) -> None:
        if self.conversation.chat_id is not None:
            self._rename_chat(self.conversation.chat_id)

    def _rename_chat(self, chat_id: int) -> None:
        store = self.app.store

        def rename(title: str | None) -> None:
            if title and title.strip() and self._write(store.rename_chat, chat_id, title.strip()):
                self.refresh_chat_list()

        self.app.push_screen(TextDialog("Rename chat", store.chat(chat_id).title), rename)

    async def action_system_prompt(self) -> None:
        store = self.app.store
        if self.conversation.chat_id is None:
            try:
                await self._open_new_chat("New chat")
            except StoreError as exc:
                self._not_written(exc)
                return
        chat = store.chat(self.current_chat_id())

        def save(prompt: str | None) -> None:
            if prompt is not None and self._write(store.set_system_prompt, chat.id, prompt):
                self.notify("System prompt saved (it applies from the next message)")

        self.app.push_screen(TextDialog("System prompt for this chat", chat.system_prompt,
                                        "You are a helpful assistant."), save)

    def action_export_chat(self) -> None:
        if self.conversation.chat_id is None:
            return
        store = self.app.store
        chat = store.chat(self.current_chat_id())
        path = export_path(self.app.data_dir, chat.id)
        path.write_text(export_markdown(chat, store.messages(chat.id), store.all_messages(chat.id)),
                        encoding="utf-8")
        self.notify(f"Exported to {path}")

    def action_delete_chat(self) -> None:
        if self.conversation.chat_id is not None:
            self._delete_chat(self.conversation.chat_id)

    def _delete_chat(self, chat_id: int) -> None:
        store = self.app.store
        if chat_id == self.conversation.chat_id and self.conversation.generating:
            self.notify("A reply is streaming in this chat: Esc stops it first", severity="warning")
            return

        async def delete(confirmed: bool | None) -> None:
            if not confirmed:
                return
            deleted = (store.chat(chat_id), store.all_messages(chat_id))
            if not self._write(store.delete_chat, chat_id):
                return
            self._deleted = deleted
            keys = key_label(effective_keys(BY_ID["restore_chat"], self.app.settings.keymap))
            self.notify(f"Deleted {deleted[0].title!r}: {keys} brings it back")
            if chat_id == self.conversation.chat_id:
                await self.conversation.show_chat(None)
            self.refresh_chat_list()

        self.app.push_screen(ConfirmDialog(f"Delete the chat {store.chat(chat_id).title!r}?"),
                             delete)

    def action_delete_message(self) -> None:
        """The selected message and every one after it, in every branch (confirmed first)."""
        view = self.focused
        if not isinstance(view, MessageView) or self.conversation.generating:
            self.notify("Select a message first (Tab moves to the messages)", severity="warning")
            return
        chat_id, store = self.conversation.chat_id, self.app.store

        async def delete(confirmed: bool | None) -> None:
            if confirmed and self._write(store.delete_messages_from, chat_id, view.message_id):
                await self.conversation.show_chat(chat_id)

        later = following(store.all_messages(chat_id), view.message_id)
        what = "reply" if view.role == "assistant" else "prompt"
        question = (f"Delete this {what} and the {later} that follow it (in every branch)?"
                    if later else f"Delete this {what}?")
        self.app.push_screen(ConfirmDialog(question), delete)

    def action_restore_chat(self) -> None:
        if self._deleted is None:
            self.notify("No chat was deleted since the app started", severity="warning")
            return
        try:
            chat_id = restore_chat(self.app.store, *self._deleted)
        except StoreError as exc:
            self._not_written(exc)
            return
        self._deleted = None
        self.call_later(self.open_chat, chat_id)
        self.notify("The chat is back")


def following(messages: list, message_id: int) -> int:
    """How many messages follow `message_id` in the chat's tree (every branch)."""
    children: dict[int | None, list[int]] = {}
    for message in messages:
        children.setdefault(message.parent_id, []).append(message.id)
    pending, count = [message_id], 0
    while pending:
        below = children.get(pending.pop(), [])
        count += len(below)
        pending += below
    return count


def restore_chat(store: ChatStore, chat, messages: list) -> int:
    """Write a deleted chat again (new ids, the same tree, values and branch shown)."""
    restored = store.create_chat(chat.title, chat.system_prompt, chat.created)
    store.set_chat_settings(restored.id, chat.settings)
    new_ids: dict[int | None, int | None] = {None: None}
    for message in messages:
        parent = new_ids.get(message.parent_id, HEAD)
        added = store.add_message(restored.id, message.role, message.content, message.status,
                                  message.meta, parent)
        new_ids[message.id] = added.id
    head = chat.head_id if chat.head_id in new_ids else (messages[-1].id if messages else None)
    if head is not None:
        store.show_version(restored.id, new_ids[head])
    if chat.context_from:
        kept = [new for old, new in new_ids.items() if old is not None and old >= chat.context_from]
        store.set_context_from(restored.id, min(kept, default=0))
    return restored.id


def export_path(data_dir: Path, chat_id: int) -> Path:
    folder = data_dir / "exports"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"chat-{chat_id}.md"
