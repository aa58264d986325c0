"""What the tmux walkthrough of issue 51 (a new user, 150x45 and 80x24, the embedded pair) found,
each driven here through Pilot with no service: a reply's chunks arrive as its worker posts them."""

from __future__ import annotations

import time

import pytest
from dflash_chat.context_fit import ContextOverflow
from dflash_chat.screens.chat_send import SendFlow
from dflash_chat.screens.dialogs import ConfirmDialog
from dflash_chat.screens.presets import PresetScreen
from dflash_chat.settings import Settings
from dflash_chat.storage import DB_NAME, ChatStore
from dflash_chat.widgets.conversation import Conversation
from dflash_chat.widgets.prompt_input import PromptInput
from dflash_chat.widgets.status_bar import StatusBar
from textual import events
from tui_support import chunk, run_offline, screen_lines, until

WIDE, NARROW = (150, 45), (80, 24)
CLASS_REPLY = ("class BankAccount:\n    def __init__(self, account_number, initial_balance=0):\n"
               "        self.account_number = account_number\n"
               "        self.balance = initial_balance\n\n    def deposit(self, amount):\n"
               "        if amount <= 0:\n"
               "            raise ValueError(\"You can only deposit a positive")
PASTE = "\n".join(f"{i}. a pasted line of a long text" for i in range(60))


# Ctrl+Z after a long paste (say, one the context refused) crashed the app
@pytest.mark.parametrize("size", [NARROW, WIDE])
def test_undo_takes_a_long_paste_back(home, size):
    async def scenario(app, pilot):
        prompt = app.chat_screen.query_one(PromptInput)
        await pilot.press(*"Read:")
        app.post_message(events.Paste(PASTE))
        await until(pilot, lambda: prompt.value.endswith("long text"), "pasted")
        await pilot.press("ctrl+z")
        await until(pilot, lambda: prompt.value == "Read:", "the paste taken back")
        assert app.is_running
    run_offline(scenario, size)


async def reply_started(app, pilot) -> int:
    app.chat_screen.query_one(PromptInput).value = "Write a bank account class."
    await pilot.press("enter")
    conversation = app.chat_screen.conversation
    await until(pilot, lambda: conversation.generating, "reply started")
    reply_id = conversation.last_view("assistant").message_id
    conversation.post_message(Conversation.RequestSent(reply_id, time.monotonic()))
    return reply_id


# the end of a reply was left below the fold: its Markdown renders in batches after each chunk,
# and the next chunk took the grown view for one the user had scrolled up
@pytest.mark.parametrize("size", [NARROW, WIDE])
def test_the_conversation_follows_a_reply_to_its_last_line(home, size):
    store = ChatStore(home / DB_NAME)
    chat = store.create_chat("Long enough to scroll")
    for turn in range(12):
        store.add_message(chat.id, "user", f"Question {turn}?")
        store.add_message(chat.id, "assistant", f"Answer {turn}.")
    store.close()

    async def scenario(app, pilot):
        conversation = app.chat_screen.conversation
        reply_id = await reply_started(app, pilot)
        for n, start in enumerate(range(0, len(CLASS_REPLY), 6)):  # a round's text each
            part = chunk(CLASS_REPLY[start:start + 6], [1], 0, n)
            conversation.post_message(Conversation.ChunksArrived(reply_id, [part]))
            await pilot.pause(0.03)
        conversation.post_message(Conversation.StreamEnded(reply_id, "done", None, None))
        await until(pilot, lambda: not conversation.generating, "reply ended")
        await until(pilot, lambda: any("positive" in line for line in screen_lines(app)),
                    "the reply's last line on screen", timeout=5)
    run_offline(scenario, size)


# Alt+P, Alt+O, Alt+D typed "p", "o", "d" into the prompt: a terminal's Alt+P is ESC p, which
# arrives as the key alt+p with the character "p", and the prompt took it as text
def test_alt_keys_reach_their_actions_from_the_prompt(home):
    async def scenario(app, pilot):
        prompt = app.chat_screen.query_one(PromptInput)
        assert prompt.has_focus
        app.post_message(events.Key("alt+o", "o"))  # as the terminal's parser posts it
        await until(pilot, lambda: "context is full" in notices(app), "the policy switched")
        app.post_message(events.Key("alt+p", "p"))
        await until(pilot, lambda: isinstance(app.screen, PresetScreen), "presets opened")
        assert prompt.value == ""
    run_offline(scenario, NARROW)


def notices(app) -> str:
    return "\n".join(str(n.message) for n in app._notifications)


# the overflow notices named fixed keys (Ctrl+N, Alt+O) whatever the user's keymap said
def test_the_overflow_notice_names_the_users_own_keys(home):
    keymap = {"new_chat": "f12", "toggle_overflow": "ctrl+w"}
    refused = ContextOverflow(9000, 8192, 64, "refuse")
    assert "Ctrl+N" in str(refused) or "ctrl+n" in str(refused)  # without a keymap: the defaults

    async def scenario(app, pilot):
        app.chat_screen.post_message(SendFlow.PromptRefused(refused))
        await until(pilot, lambda: "f12" in notices(app), "the refusal said")
        assert "ctrl+w" in notices(app) and "ctrl+n" not in notices(app).lower()
    run_offline(scenario, NARROW, settings=Settings(keymap=keymap))


# at 80 columns the pair's name pushed the next message's modes (SPEC ON/OFF) off the status bar
@pytest.mark.parametrize("size", [NARROW, WIDE])
def test_the_status_bar_keeps_the_modes_in_sight(home, size):
    async def scenario(app, pilot):
        bar = app.chat_screen.query_one(StatusBar)
        bar.model = "embedded (transformers, smollm2-135m-dflash)"
        bar.speed, bar.context = "4.8 tok/s τ 1.50", (54, 8192)
        await pilot.press("f2")
        await pilot.pause()
        line = screen_lines(app)[-2]
        assert "SPEC OFF" in line and "4.8 tok/s τ 1.50" in line and "ctx 54/8.2k" in line
        assert ("smollm2-135m-dflash" in line) == (size == WIDE)
    run_offline(scenario, size)


# the last reply's delete asked "Delete this message and the 0 that follow it (in every branch)?"
def test_deleting_the_last_reply_asks_plainly(home):
    store = ChatStore(home / DB_NAME)
    chat = store.create_chat("Fruits")
    store.add_message(chat.id, "user", "List five fruits.")
    store.add_message(chat.id, "assistant", "Apple, pear, plum, fig, lime.")
    store.close()

    async def scenario(app, pilot):
        app.chat_screen.conversation.last_view("assistant").focus()
        await pilot.press("alt+d")
        await until(pilot, lambda: isinstance(app.screen, ConfirmDialog), "asked")
        said = " ".join(" ".join(screen_lines(app)).split())
        assert "Delete this reply?" in said and " 0 " not in said
        await pilot.press("y")
        await until(pilot, lambda: app.chat_screen.conversation.last_view("assistant") is None,
                    "the reply deleted")
    run_offline(scenario, NARROW)
