"""The chat screen: chats on the left, the conversation and the prompt in the middle, the live
speed panel on the right, the modes of the next message in the status bar."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer

from dflash_chat.actions import BY_ID, CHAT, effective_keys, key_label
from dflash_chat.bindings import bindings_for
from dflash_chat.chat_text import distinct_title
from dflash_chat.context_fit import policy_words
from dflash_chat.screens.chat_manage import ChatActions
from dflash_chat.screens.chat_presets import PresetActions
from dflash_chat.screens.chat_send import SendFlow
from dflash_chat.settings import OVERFLOW_POLICIES, THINKING_MODES, Settings
from dflash_chat.stats import SpeedSnapshot, final_snapshot
from dflash_chat.storage import StoreError
from dflash_chat.widgets.chat_list import ChatList
from dflash_chat.widgets.conversation import Conversation
from dflash_chat.widgets.message import MessageView, code_blocks
from dflash_chat.widgets.prompt_input import PromptInput
from dflash_chat.widgets.speed_panel import SpeedPanel, compact_speed_text
from dflash_chat.widgets.status_bar import StatusBar


class ChatScreen(SendFlow, PresetActions, ChatActions, Screen):
    CSS_PATH = "chat.tcss"
    BINDINGS = bindings_for(CHAT)
    AUTO_FOCUS = "#prompt"

    _editing: int | None = None  # the prompt being edited: it and what follows are replaced
    _code_copied: tuple[int, int, int] | None = None  # Ctrl+B's last: message, block, blocks

    def compose(self) -> ComposeResult:
        store = self.app.store
        with Horizontal(id="body"):
            yield ChatList(id="chats")
            with Vertical(id="main"):
                yield Conversation(store, id="conversation")
                yield PromptInput(store.prompt_history(), id="prompt")
            yield SpeedPanel(id="speed")
        yield StatusBar(id="status")
        yield Footer(compact=True, show_command_palette=False)  # the prompt names Ctrl+P

    @property
    def conversation(self) -> Conversation:
        return self.query_one(Conversation)

    def on_resize(self, event) -> None:
        """Below NARROW_COLUMNS the side panels step aside (their keys bring them back)."""
        self.set_class(event.size.width < NARROW_COLUMNS, "-narrow")

    async def on_mount(self) -> None:
        self.set_class(self.app.size.width < NARROW_COLUMNS, "-narrow")
        self.watch(self.app, "settings", self._show_settings)
        self.watch(self.app, "service_state", self._show_service)
        self.watch(self.app, "model_label", self._show_service)
        chats = self.app.store.chats()
        await self.open_chat(chats[0].id if chats else None)

    def _show_settings(self, settings: Settings) -> None:
        bar = self.query_one(StatusBar)
        bar.speculative, bar.thinking = settings.speculative, settings.thinking
        bar.show_accepted = settings.show_accepted
        bar.warning = self.app.thinking_warning()
        self.conversation.set_show_accepted(settings.show_accepted)

    def _show_service(self) -> None:
        bar = self.query_one(StatusBar)
        state = self.app.service_state
        if state == "service stopped":
            state += f" ({self.app.keys_of('restart_service')} restarts it)"
        bar.service, bar.model = state, self.app.model_label
        bar.warning = self.app.thinking_warning()
        self.query_one(SpeedPanel).pair = self.app.model_label
        last = self.conversation.last_view("assistant")  # the meter, once the context is known
        if last is not None and not self.conversation.generating:
            self._show_context(self._context_of(reply_snapshot(last.meta)))

    # --- chats ---

    async def open_chat(self, chat_id: int | None) -> None:
        if self.conversation.generating:
            self.notify("A reply is streaming: Esc stops it first", severity="warning")
            return
        self._editing = None
        await self.conversation.show_chat(chat_id)
        self.refresh_chat_list()
        last = self.conversation.last_view("assistant")  # the panel shows this chat's figures
        self._show_speed(reply_snapshot(last.meta if last else {}))
        self.app.apply_chat_settings(self.app.store.chat(chat_id) if chat_id is not None else None)

    async def _open_new_chat(self, title: str) -> None:
        """Store a new chat with the values chosen for it so far (F2, Ctrl+T), then open it."""
        taken = [chat.title for chat in self.app.store.chats()]
        chat = self.app.store.create_chat(distinct_title(title, taken),
                                          self.app.settings.system_prompt)
        self.app.store.set_chat_settings(chat.id, self.app.chat_settings())
        await self.open_chat(chat.id)

    def refresh_chat_list(self) -> None:
        self.query_one(ChatList).show(self.app.store.chats(), self.conversation.chat_id)

    def current_chat_id(self) -> int:
        if self.conversation.chat_id is None:
            raise LookupError("no chat is open")
        return self.conversation.chat_id

    async def on_chat_list_chat_selected(self, message: ChatList.ChatSelected) -> None:
        if type(message) is ChatList.ChatSelected:
            await self.open_chat(message.chat_id)
            if self.has_class("-show-chats"):  # the list over the conversation steps aside
                self.remove_class("-show-chats")
                self.query_one(PromptInput).focus()

    def on_chat_list_delete_requested(self, message: ChatList.DeleteRequested) -> None:
        self._delete_chat(message.chat_id)

    def on_chat_list_rename_requested(self, message: ChatList.RenameRequested) -> None:
        self._rename_chat(message.chat_id)

    # --- sending ---

    def on_conversation_speed(self, message: Conversation.Speed) -> None:
        self._show_speed(message.snapshot)

    def _show_speed(self, snapshot: SpeedSnapshot) -> None:
        """The panel's figures, and their compact line in the status bar (seen at every width)."""
        self.query_one(SpeedPanel).snapshot = snapshot
        self.query_one(StatusBar).speed = compact_speed_text(snapshot)
        self._show_context(self._context_of(snapshot))

    def on_descendant_focus(self, event) -> None:
        """A reply selected: the panel shows its figures (the streaming one shows itself)."""
        view = event.widget
        if isinstance(view, MessageView) and view.role == "assistant" and not (
                self.conversation.generating and view is self.conversation.last_view("assistant")):
            self._show_speed(reply_snapshot(view.meta))

    # --- actions (ids in actions.py) ---

    def action_stop(self) -> None:
        if self.conversation.stop():
            self.notify("Stopped: the partial reply is kept")

    def action_toggle_chats(self) -> None:
        self._toggle_panel("chats")

    def action_toggle_speed(self) -> None:
        self._toggle_panel("speed")

    def _toggle_panel(self, panel: str) -> None:
        """Wide: hide or show it in place. Narrow: show it over the conversation, or hide it.
        A chat list brought up takes the focus (arrows pick a chat); hidden, the prompt has it."""
        self.toggle_class(f"-show-{panel}" if self.has_class("-narrow") else f"-hide-{panel}")
        if panel == "chats":
            chats = self.query_one(ChatList)
            self.call_after_refresh(chats.focus if chats.display else self.query_one(
                PromptInput).focus)

    async def action_search_chats(self) -> None:
        from dflash_chat.screens.search import SearchScreen

        async def open_hit(chat_id: int | None) -> None:
            if chat_id is not None:
                await self.open_chat(chat_id)

        self.app.push_screen(SearchScreen(), open_hit)

    def action_edit_in_editor(self) -> None:
        from textual.app import SuspendNotSupported

        from dflash_chat.editor import EditorError, edit_text

        prompt = self.query_one(PromptInput)
        try:
            try:
                with self.app.suspend():
                    edited = edit_text(prompt.text)
            except SuspendNotSupported:  # no terminal to hand over (headless): run it as is
                edited = edit_text(prompt.text)
        except EditorError as exc:
            self.notify(str(exc), severity="error")
            return
        prompt.value = edited
        prompt.focus()

    def action_toggle_speculative(self) -> None:
        speculative = not self.app.settings.speculative
        self._set_chat_value(speculative=speculative)
        self.notify(f"Speculative decoding {'on' if speculative else 'off'} for the next message")

    def _set_chat_value(self, **changes) -> None:
        """A key's change of the open chat's own values: kept with the chat at once (the saved
        defaults change only from the settings screen)."""
        self.app.update_settings(**changes)
        if self.conversation.chat_id is not None:
            self._write(self.app.store.set_chat_settings, self.conversation.chat_id,
                        self.app.chat_settings())

    def _write(self, write, *args) -> bool:
        """A store write a key asked for: one the disk refuses (full) is said, not a crash."""
        try:
            write(*args)
        except StoreError as exc:
            self._not_written(exc)
            return False
        return True

    def _not_written(self, error: StoreError) -> None:
        self.notify(f"The chat history could not be written: {error}", severity="error",
                    timeout=30)

    def action_toggle_accepted(self) -> None:
        self.app.update_settings(show_accepted=not self.app.settings.show_accepted)

    def action_toggle_thinking(self) -> None:
        modes = THINKING_MODES
        mode = modes[(modes.index(self.app.settings.thinking) + 1) % len(modes)]
        self._set_chat_value(thinking=mode)
        warning = self.app.thinking_warning()
        self.notify(f"Thinking {mode}" + (f": {warning}" if warning else ""),
                    severity="warning" if warning else "information")

    def action_toggle_overflow(self) -> None:
        policies = OVERFLOW_POLICIES
        policy = policies[(policies.index(self.app.settings.overflow) + 1) % len(policies)]
        self._set_chat_value(overflow=policy)
        words = policy_words(policy, self.app.settings.keep_turns)
        self.notify(f"When this chat's context is full, {words}")

    async def action_new_chat(self) -> None:
        await self.open_chat(None)
        self.query_one(PromptInput).focus()

    async def action_regenerate(self) -> None:
        conversation = self.conversation
        last = conversation.last_view("assistant")
        if conversation.generating or last is None:
            return
        settings = self.app.settings
        parent = self.app.store.message(last.message_id).parent_id  # the prompt it answers
        await conversation.forget_from(last.message_id)  # stored still: ←/→ on the new reply
        try:
            await conversation.start_reply(settings.sampling(), settings.speculative, parent)
        except StoreError as exc:
            self._not_written(exc)
            await conversation.show_chat(conversation.chat_id)

    def action_edit_last(self) -> None:
        """The selected prompt, or the last: Enter sends the edit as a new version of it."""
        focused = self.focused
        chosen = focused if isinstance(focused, MessageView) and focused.role == "user" else None
        chosen = chosen or self.conversation.last_view("user")
        if self.conversation.generating or chosen is None:
            return
        self._editing = chosen.message_id
        prompt = self.query_one(PromptInput)
        prompt.value = chosen.text
        prompt.focus()
        self.notify("Editing this prompt: Enter sends it as a new version (the old one and its "
                    "replies stay: ←/→ on it)")

    async def on_conversation_branch_shown(self, message: Conversation.BranchShown) -> None:
        self._editing = None
        last = self.conversation.last_view("assistant")
        self._show_speed(reply_snapshot(last.meta if last else {}))
        shown = next((v for v in self.conversation.views() if v.message_id == message.message_id),
                     None)
        if shown is not None:
            shown.focus()

    def _selected_view(self) -> MessageView | None:
        focused = self.focused
        if isinstance(focused, MessageView):
            return focused
        return self.conversation.last_view("assistant")

    def action_copy_message(self) -> None:
        """The reply's answer; its reasoning stays out (what a user pastes on is the answer)."""
        view = self._selected_view()
        if view is not None:
            self.app.copy_to_clipboard(view.text)
            self._code_copied = None  # Ctrl+B starts from the last block again
            left_out = ", not its reasoning" if view.reasoning else ""
            self.notify(f"Copied {len(view.text)} characters{left_out}")

    def action_copy_code(self) -> None:
        """The answer's last code block; pressed again on the same reply, the block before it
        (the notice says which of how many). A block cut by max tokens or Esc counts."""
        view = self._selected_view()
        blocks = code_blocks(view.text) if view is not None else []  # the answer's alone
        if not blocks:
            self.notify("No code block in that message", severity="warning")
            return
        index = code_block_to_copy(self._code_copied, view.message_id, len(blocks))
        self._code_copied = (view.message_id, index, len(blocks))
        self.app.copy_to_clipboard(blocks[index])
        if len(blocks) == 1:
            self.notify(f"Copied the code block ({len(blocks[0])} characters)")
            return
        keys = key_label(effective_keys(BY_ID["copy_code"], self.app.settings.keymap))
        before = (index - 1) % len(blocks)
        self.notify(f"Copied code block {index + 1} of {len(blocks)} ({len(blocks[index])} "
                    f"characters); {keys} again copies block {before + 1}")


NARROW_COLUMNS = 110  # below this the chat list and the speed panel step aside


def reply_snapshot(meta: dict) -> SpeedSnapshot:
    """A stored reply's figures for the speed panel (none: the panel says so)."""
    return final_snapshot(meta["stats"]) if meta.get("stats") else SpeedSnapshot()


def code_block_to_copy(copied: tuple[int, int, int] | None, message_id: int, count: int) -> int:
    """Which of a reply's `count` code blocks Ctrl+B copies: the last, or after a copy from the
    same reply (with as many blocks), the one before that copy's (wrapping round)."""
    if copied is None or copied[0] != message_id or copied[2] != count:
        return count - 1
    return (copied[1] - 1) % count
