"""dflash-chat's context meter and overflow policy against the real service (a tiny pair in
this process, its context 1024 tokens, one token a byte): the app's count is the service's own,
a chat past the context is sent with its oldest turns left out and marked, and under "refuse" a
message that does not fit is kept in the field, never stored."""

from __future__ import annotations

import asyncio

import pytest
from dflash_chat.app import DFlashChatApp, Options
from dflash_chat.context_fit import SUMMARY_ASK
from dflash_chat.settings import Settings
from dflash_chat.storage import DB_NAME, ChatStore
from dflash_chat.widgets.prompt_input import PromptInput
from dflash_chat.widgets.status_bar import StatusBar
from service_support import serve_module
from tui_support import until

TURNS = 12  # about 60 tokens a message: 24 messages overflow 1024 tokens


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    yield from serve_module(tmp_path_factory)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_LOCAL_HOME", str(tmp_path))
    store = ChatStore(tmp_path / DB_NAME)
    chat = store.create_chat("A long chat")
    for turn in range(TURNS):
        store.add_message(chat.id, "user", f"Question {turn}: " + "tell me more please " * 2)
        store.add_message(chat.id, "assistant", f"Answer {turn}: " + "here is a bit more " * 2)
    store.close()
    return tmp_path


async def replied(pilot, app, views: int) -> None:
    """The reply sent last is on screen (`views` messages shown) and stored, finished."""
    conversation = app.chat_screen.conversation
    await until(pilot, lambda: len(conversation.views()) == views, "sent", 60)
    reply_id = conversation.last_view("assistant").message_id
    await until(pilot, lambda: app.store.message(reply_id).status != "streaming", "replied", 120)
    await until(pilot, lambda: not conversation.generating, "the reply's end handled")


def said(app) -> str:
    return "\n".join(str(note.message) for note in app._notifications)


def test_a_chat_past_the_context_drops_its_oldest_turns_and_refuse_keeps_the_prompt(served, home):
    _, server = served

    async def scenario():
        app = DFlashChatApp(Options(server=server.url), settings=Settings(max_tokens=16))
        async with app.run_test(size=(150, 45)) as pilot:
            await until(pilot, lambda: app.service_ready.is_set(), "service ready", 120)
            assert app.loaded_context() == 1024
            conversation, prompt = app.chat_screen.conversation, app.chat_screen.query_one(PromptInput)
            chat_id = conversation.chat_id
            prompt.value = "And the next one?"
            await pilot.press("enter")
            await replied(pilot, app, 2 * TURNS + 2)
            reply = app.store.messages(chat_id)[-1]
            assert reply.status == "done", reply.meta
            stats = reply.meta["stats"]
            assert stats["prompt_tokens"] == app.chat_screen._sent_tokens  # counted as served
            assert stats["prompt_tokens"] <= 1024 - 16
            first_kept = app.store.chat(chat_id).context_from
            views = conversation.views()
            left_out = [view for view in views if view.left_out]
            assert left_out and left_out == views[:len(left_out)]  # the oldest, all shown
            assert views[len(left_out)].message_id == first_kept and "left out" in said(app)
            used = stats["prompt_tokens"] + stats["completion_tokens"]
            assert app.chat_screen.query_one(StatusBar).context == (used, 1024)

            await pilot.press("alt+o")  # this chat: refuse
            assert app.settings.overflow == "refuse"
            stored = len(app.store.messages(chat_id))
            prompt.value = "Far too long. " * 80
            await pilot.press("enter")
            await until(pilot, lambda: "does not fit" in "\n".join(
                str(n.title) for n in app._notifications), "refused")
            assert len(app.store.messages(chat_id)) == stored
            assert prompt.value == "Far too long. " * 80 and "policy is refuse" in said(app)
    asyncio.run(scenario())


def test_summarise_sends_the_models_summary_in_place_of_the_turns_left_out(served, home):
    """The prompt shows, with a notice, while the summary is written; then the reply."""
    _, server = served

    async def scenario():
        settings = Settings(max_tokens=16, overflow="summarise")
        app = DFlashChatApp(Options(server=server.url), settings=settings)
        async with app.run_test(size=(150, 45)) as pilot:
            await until(pilot, lambda: app.service_ready.is_set(), "service ready", 120)
            conversation, prompt = app.chat_screen.conversation, app.chat_screen.query_one(PromptInput)
            chat_id, stream_chat, asked = conversation.chat_id, app.client.stream_chat, []

            def seen_when_asked(messages: list[dict], **options):
                if messages[-1]["content"] == SUMMARY_ASK:  # what the screen shows meanwhile
                    last = conversation.views()[-1]
                    asked.append((last.role, app.store.message(last.message_id).content, said(app)))
                return stream_chat(messages, **options)

            app.client.stream_chat = seen_when_asked
            prompt.value = "And the next one?"
            await pilot.press("enter")
            await replied(pilot, app, 2 * TURNS + 2)
            [(role, content, notices)] = asked
            chat = app.store.chat(chat_id)
            assert chat.context_from and chat.context_summary and "summary" in said(app)
            turns = sum(m.role == "user" and m.id < chat.context_from
                        for m in app.store.messages(chat_id))
            assert role == "user" and content == "And the next one?"
            assert f"Summarising {turns} earlier turns" in notices and "left out" not in notices
            assert len(said(app)) < 300  # a toast, not the summary whole
            system = conversation.request_messages()[0]
            assert system["role"] == "system" and system["content"].endswith(chat.context_summary)
            prompt.value = "Go on."  # the summary stays: the next send's start is cached
            await pilot.press("enter")
            await replied(pilot, app, 2 * TURNS + 4)
            stats = app.store.messages(chat_id)[-1].meta["stats"]
            probe, model = [{"role": "user", "content": "x"}], app.served_model()
            summary_tokens = (await app.client.count_tokens(model, [system, *probe])
                              - await app.client.count_tokens(model, probe))
            assert app.store.chat(chat_id).context_summary == chat.context_summary
            assert stats["cached_tokens"] >= summary_tokens
    asyncio.run(scenario())


def test_a_fork_at_an_earlier_prompt_is_served_with_the_shared_prefix_cached(served, home):
    _, server = served

    async def scenario():
        app = DFlashChatApp(Options(server=server.url), settings=Settings(max_tokens=8))
        async with app.run_test(size=(150, 45)) as pilot:
            await until(pilot, lambda: app.service_ready.is_set(), "service ready", 120)
            await pilot.press("ctrl+n")
            conversation, prompt = app.chat_screen.conversation, app.chat_screen.query_one(PromptInput)
            for turn in range(6):
                prompt.value = f"Turn {turn}: say something."
                await pilot.press("enter")
                await replied(pilot, app, 2 * turn + 2)
            chat_id = conversation.chat_id
            before_fork = [{"role": m.role, "content": m.content}
                           for m in app.store.messages(chat_id)[:6]]
            probe = [{"role": "user", "content": "x"}]
            shared = (await app.client.count_tokens(app.served_model(), before_fork + probe)
                      - await app.client.count_tokens(app.served_model(), probe))
            conversation.views()[6].focus()  # turn 3's prompt
            await pilot.press("ctrl+o")
            prompt.value = "Turn 3, asked another way."
            await pilot.press("enter")
            await replied(pilot, app, 8)
            reply = app.store.messages(chat_id)[-1]
            assert reply.status == "done" and reply.meta["stats"]["cached_tokens"] >= shared > 0
            assert len(app.store.all_messages(chat_id)) == 14  # the first branch is kept
    asyncio.run(scenario())
