"""dflash-chat shows a reasoning model's reasoning: a real service serving harmony_tiny's target
(analysis then final), driven through the real app by Pilot; export, search, copy and the race
each put it where it belongs. Waits are for conditions."""

from __future__ import annotations

import asyncio

import pytest
from dflash_chat.app import DFlashChatApp, Options
from dflash_chat.protocol import StreamChunk
from dflash_chat.screens.race import RaceScreen
from dflash_chat.screens.search import SearchScreen
from dflash_chat.settings import Settings
from dflash_chat.widgets.prompt_input import PromptInput
from dflash_chat.widgets.race_lane import RaceLane
from dflash_chat.widgets.reasoning import reasoning_block_in
from dflash_chat.widgets.speed_panel import SpeedPanel
from harmony_tiny import GREETING, HELLO, REASONING, harmony_pair
from service_support import start_service
from textual.widgets import Input, OptionList, Static
from textual.widgets._collapsible import CollapsibleTitle
from tui_support import run_offline, until

SIZE = (120, 40)


@pytest.fixture(scope="module")
def service_url(tmp_path_factory):
    pair = harmony_pair(tmp_path_factory)
    _, server = start_service(pair.target, pair.drafter,
                              hub_cache_dir=tmp_path_factory.mktemp("hub"))
    yield server.url
    server.stop()


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


def said(app) -> str:
    return "\n".join(str(note.message) for note in app._notifications)


def test_export_search_and_copy_see_the_reasoning_where_it_belongs(service_url, home):
    async def scenario():
        app = make_app(service_url)
        async with app.run_test(size=SIZE) as pilot:
            view = await greet(pilot, app)
            chat_id = app.chat_screen.conversation.chat_id
            await pilot.press("ctrl+y")
            assert app.clipboard == HELLO and "not its reasoning" in said(app)
            await pilot.press("f9")  # the reasoning, collapsed, before the answer
            exported = (home / "exports" / f"chat-{chat_id}.md").read_text()
            details = exported.index("<details><summary>Reasoning</summary>")
            assert details < exported.index(REASONING) < exported.index("</details>")
            assert exported.index("</details>") < exported.index(HELLO)
            await app.chat_screen.open_chat(None)  # the hit has a chat to open
            await pilot.press("ctrl+f")
            search = app.screen
            assert isinstance(search, SearchScreen)
            hits = search.query_one(OptionList)
            def hit() -> str:  # the words found shown as [word]: highlighted on the screen
                if hits.option_count != 1:
                    return ""
                label = hits.get_option_at_index(0).prompt
                return "".join(f"[{label.plain[span.start:span.end]}]"
                               if "reverse" in str(span.style) else "" for span in label.spans
                               ) + " " + label.plain

            search.query_one(Input).value = "greet"
            await until(pilot, lambda: "[Greet]" in hit() and "in the reasoning: Greet back."
                        in hit(), "reasoning hit")
            search.query_one(Input).value = "there"
            await until(pilot, lambda: "[there]" in hit() and "Hello there!" in hit(), "answer hit")
            assert "in the reasoning" not in hit()
            await pilot.press("enter")
            await until(pilot, lambda: app.chat_screen.conversation.chat_id == chat_id, "opened")
            assert app.chat_screen.conversation.last_view("assistant").reasoning == view.reasoning
    asyncio.run(scenario())


def test_copy_code_takes_the_answers_code_not_the_reasonings(home):
    async def scenario(app, pilot):
        store = app.store
        chat = store.create_chat("Code")
        store.add_message(chat.id, "user", "Print hi?")
        store.add_message(chat.id, "assistant", "Use:\n```py\nprint('hi')\n```\n", meta={
            "reasoning": "Maybe:\n```py\nsys.stdout.write('hi')\n```\nNo, simpler."})
        store.add_message(chat.id, "user", "And without code?")
        store.add_message(chat.id, "assistant", "Say hi.", meta={
            "reasoning": "Code would be:\n```py\nprint('hi')\n```\nbut words do."})
        await app.chat_screen.open_chat(chat.id)
        await pilot.pause()
        await pilot.press("ctrl+b")  # the last reply: code only in its reasoning
        assert "No code block in that message" in said(app) and app.clipboard == ""
        first = app.chat_screen.conversation.views()[1]
        first.focus()
        await pilot.press("ctrl+b")
        assert app.clipboard == "print('hi')\n"
        await pilot.press("ctrl+y")
        assert app.clipboard == first.text
    run_offline(scenario, SIZE)


def test_race_lanes_show_each_runs_reasoning_above_its_answer(service_url, home):
    async def scenario():
        app = make_app(service_url)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, app.service_ready.is_set, "service ready", timeout=180)
            await pilot.press("f4")
            race = app.screen
            assert isinstance(race, RaceScreen)
            race.query_one("#race-prompt").value = GREETING
            await pilot.press("enter")
            await until(pilot, lambda: race.verdict is not None, "race verdict", timeout=180)
            await pilot.pause()
            assert race.verdict.identical
            for lane in race.query(RaceLane):
                block = reasoning_block_in(lane)
                assert (lane.text, lane.reasoning) == (HELLO, REASONING), lane.id
                assert block.collapsed and block.title == "Reasoning"
                assert str(block.query_one(".reasoning-text", Static).content) == REASONING
                assert block.region.y < lane.query_one(".body").region.y  # above the answer
    asyncio.run(scenario())


def test_a_new_race_drops_the_last_ones_reasoning(home):
    async def scenario(app, pilot):
        race = RaceScreen(prompt="hi")
        await app.push_screen(race)
        runs = ([StreamChunk("", (1,), reasoning="Think."), StreamChunk("Hi.", (2,))],
                [StreamChunk("Hello.", (3,))])
        for chunks in runs:
            race.post_message(RaceScreen.LaneStarted("plain"))
            race.post_message(RaceScreen.LaneChunks("plain", chunks))
            await pilot.pause()
            lane = race.query_one("#lane-plain", RaceLane)
            assert lane.text == "".join(chunk.text for chunk in chunks)
            shown = reasoning_block_in(lane)
            assert (shown is not None) == (chunks is runs[0]) and lane.reasoning == (
                "Think." if shown else "")
    run_offline(scenario, SIZE)
