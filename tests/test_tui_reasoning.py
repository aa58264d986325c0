"""dflash-chat shows a reasoning model's reasoning: a real service serving harmony_tiny's target
(analysis then final), driven through the real app by Pilot. Waits are for conditions."""

from __future__ import annotations

import asyncio

import pytest
from dflash_chat.app import DFlashChatApp, Options
from dflash_chat.settings import Settings
from dflash_chat.widgets.prompt_input import PromptInput
from dflash_chat.widgets.speed_panel import SpeedPanel
from harmony_tiny import GREETING, HELLO, REASONING, harmony_pair
from service_support import start_service
from textual.widgets import Static
from textual.widgets._collapsible import CollapsibleTitle
from tui_support import until

SIZE = (120, 40)


@pytest.fixture(scope="module")
def service_url(tmp_path_factory):
    pair = harmony_pair(tmp_path_factory)
    _, server = start_service(pair.target, pair.drafter,
                              hub_cache_dir=tmp_path_factory.mktemp("hub"))
    yield server.url
    server.stop()


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_LOCAL_HOME", str(tmp_path))
    return tmp_path


def make_app(url: str) -> DFlashChatApp:
    return DFlashChatApp(Options(server=url), settings=Settings(max_tokens=160))


def shown_reasoning(view) -> str:
    return str(view.reasoning_view.query_one(".reasoning-text", Static).content)


async def greet(pilot, app: DFlashChatApp):
    conversation = app.chat_screen.conversation
    await until(pilot, app.service_ready.is_set, "service ready", timeout=180)
    app.chat_screen.query_one(PromptInput).value = GREETING
    await pilot.press("enter")
    await until(pilot, lambda: len(conversation.views()) == 2, "reply started")
    await until(pilot, lambda: not conversation.generating, "reply finished", timeout=180)
    await app.workers.wait_for_complete()
    await pilot.pause()
    return conversation.last_view("assistant")


def test_reasoning_shows_above_the_answer_collapsed_and_comes_back_reopened(service_url, home):
    async def scenario():
        app = make_app(service_url)
        async with app.run_test(size=SIZE) as pilot:
            view = await greet(pilot, app)
            assert view.text == HELLO  # the answer is the final channel alone
            assert view.reasoning == REASONING and shown_reasoning(view) == REASONING
            block = view.reasoning_view
            assert block.collapsed and block.title == "Reasoning"
            assert block.region.y < view.body.region.y  # above the answer
            stored = app.store.message(view.message_id)
            assert stored.content == HELLO and stored.meta["reasoning"] == REASONING
            snapshot = app.chat_screen.query_one(SpeedPanel).snapshot
            assert snapshot.final and snapshot.tokens == stored.meta["stats"]["completion_tokens"]
            await pilot.click(block.query_one(CollapsibleTitle))
            assert not block.collapsed  # a click opens it
            block.query_one(CollapsibleTitle).focus()
            await pilot.press("enter")
            assert block.collapsed  # and a key closes it
            # sent back, the reply is its content only (gpt-oss's template drops the analysis)
            sent = app.chat_screen.conversation.request_messages()
            assert sent[-1] == {"role": "assistant", "content": HELLO}
            chat_id = app.chat_screen.conversation.chat_id
        reopened = make_app(service_url)
        async with reopened.run_test(size=SIZE) as pilot:
            await reopened.chat_screen.open_chat(chat_id)
            await pilot.pause()
            view = reopened.chat_screen.conversation.last_view("assistant")
            assert view.text == HELLO and shown_reasoning(view) == REASONING
            assert view.reasoning_view.collapsed
    asyncio.run(scenario())


def test_reasoning_streams_open_until_the_answer_begins(home):
    """The block's life during a stream, in the real widget: open while reasoning arrives,
    collapsed by the answer's first text; a reply with no reasoning never gets one."""
    async def scenario():
        from dflash_chat.storage import Message
        from dflash_chat.widgets.message import MessageView

        app = DFlashChatApp(Options(connect=False))
        async with app.run_test(size=SIZE) as pilot:
            conversation = app.chat_screen.conversation
            thinking = MessageView(Message(1, 1, "assistant", "", "streaming", {}))
            plain = MessageView(Message(2, 1, "assistant", "", "streaming", {}))
            await conversation.mount_all([thinking, plain])
            for view in (thinking, plain):
                view.start_stream()
            await thinking.append_reasoning("Greet ")
            await thinking.append_reasoning("back.")
            await pilot.pause()
            assert not thinking.reasoning_view.collapsed
            assert shown_reasoning(thinking) == "Greet back."
            await thinking.append("Hello", [[5, 0, 1]])
            assert thinking.reasoning_view.collapsed
            await plain.append("Hello", [[5, 0, 1]])
            for view in (thinking, plain):
                await view.finish_stream()
            await pilot.pause()
            assert plain.reasoning_view is None and thinking.text == plain.text == "Hello"
    asyncio.run(scenario())
