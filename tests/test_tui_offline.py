"""dflash-chat's own behaviour with no service: settings and keymap, the palette, chat
management, copy, edit-and-resend, history, the thinking warning. Pilot-driven."""

from __future__ import annotations

import tomllib

import pytest
from dflash_chat.screens.dialogs import ConfirmDialog, TextDialog
from dflash_chat.screens.help import HelpScreen
from dflash_chat.screens.race import RaceScreen
from dflash_chat.screens.settings import SettingsScreen
from dflash_chat.storage import DB_NAME, ChatStore
from dflash_chat.widgets.prompt_input import PromptInput
from dflash_chat.widgets.status_bar import StatusBar
from textual.command import CommandList, CommandPalette
from tui_support import run_offline, serve_pair, until

SIZE = (120, 40)
REPLY = "Like this:\n\n```python\nprint('hi')\n```\n"


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_LOCAL_HOME", str(tmp_path))
    store = ChatStore(tmp_path / DB_NAME)
    chat = store.create_chat("Greeting")
    store.add_message(chat.id, "user", "How do I print?")
    store.add_message(chat.id, "assistant", REPLY, meta={"speculative": True})
    store.close()
    return tmp_path


def run(scenario) -> None:
    run_offline(scenario, SIZE)


def test_settings_are_saved_and_the_keymap_applies(home):
    async def scenario(app, pilot):
        await pilot.press("f6")
        screen = app.screen
        assert isinstance(screen, SettingsScreen)
        screen.query_one("#num-temperature").value = "hot"
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, SettingsScreen)  # refused, with the reason shown
        assert "Temperature" in str(screen.query_one("#problems").render())
        screen.query_one("#num-temperature").value = "0.7"
        screen.query_one("#key-race").value = "f12"
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert app.screen is app.chat_screen and app.settings.temperature == 0.7
        saved = tomllib.loads((home / "config" / "settings.toml").read_text())
        assert saved["temperature"] == 0.7 and saved["keymap"] == {"race": "f12"}
        await pilot.press("f12")
        await pilot.pause()
        assert isinstance(app.screen, RaceScreen)
    run(scenario)


def test_the_palette_runs_actions(home):
    async def scenario(app, pilot):
        await pilot.press("ctrl+p")
        await until(pilot, lambda: isinstance(app.screen, CommandPalette), "palette")
        await pilot.press(*"help list")
        hits = app.screen.query_one(CommandList)
        await until(pilot, lambda: hits.option_count > 0, "palette hits")
        assert "Help: list the keys" in str(hits.get_option_at_index(0).prompt)
        await pilot.press("down", "enter")
        await until(pilot, lambda: isinstance(app.screen, HelpScreen), "help screen")
        rows = app.screen.query_one("DataTable").row_count
        assert rows >= 18
    run(scenario)


def test_rename_export_delete_and_new_chat(home):
    async def scenario(app, pilot):
        conversation = app.chat_screen.conversation
        chat_id = conversation.chat_id
        await pilot.press("f7")
        assert isinstance(app.screen, TextDialog)
        app.screen.query_one("#dialog-input").value = "Printing"
        await pilot.press("enter")
        await pilot.pause()
        assert app.store.chat(chat_id).title == "Printing"
        await pilot.press("f9")
        exported = (home / "exports" / f"chat-{chat_id}.md").read_text()
        assert exported.startswith("# Printing") and "print('hi')" in exported
        await pilot.press("ctrl+g")
        assert isinstance(app.screen, ConfirmDialog)
        await pilot.press("y")
        await pilot.pause()
        assert app.store.chats() == [] and conversation.chat_id is None
        await pilot.press("ctrl+n")
        assert conversation.views() == []
    run(scenario)


def test_copy_edit_and_prompt_history(home):
    async def scenario(app, pilot):
        await pilot.press("ctrl+y")
        assert app.clipboard == REPLY
        await pilot.press("ctrl+b")
        assert app.clipboard == "print('hi')\n"
        prompt = app.chat_screen.query_one(PromptInput)
        await pilot.press("ctrl+o")
        assert prompt.value == "How do I print?" and app.chat_screen._editing is not None
        prompt.value = "draft"
        await pilot.press("up")
        assert prompt.value == "How do I print?"
        await pilot.press("down")
        assert prompt.value == "draft"
    run(scenario)


def test_thinking_mode_warns_when_the_drafter_was_trained_otherwise(home):
    async def scenario(app, pilot):
        serve_pair(app, "qwen3-4b", thinking="off")
        await pilot.press("ctrl+t")  # auto -> on
        bar = app.chat_screen.query_one(StatusBar)
        assert app.settings.thinking == "on" and "thinking off" in bar.warning
        await pilot.press("ctrl+t")  # on -> off: what it was trained for
        assert app.settings.thinking == "off" and bar.warning == ""
    run(scenario)
