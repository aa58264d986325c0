"""dflash-chat for long conversations (issue 51): the context meter and the overflow policy,
the prefix cache's tier in a reply's figures, and what a streaming reply and a first send
cost; driven through Pilot with no service (a reply's chunks arrive as its worker posts them)."""

from __future__ import annotations

import asyncio

import pytest
from dflash_chat.context_fit import (
    TRIM_TO,
    ContextOverflow,
    HistoryMessage,
    fit_history,
    meter_text,
)
from dflash_chat.protocol import StreamUsage
from dflash_chat.widgets import draft_colours
from dflash_chat.widgets.prompt_input import PromptInput
from dflash_chat.widgets.speed_panel import SpeedPanel, figures_text
from tui_support import chunk, run_offline, streamed_reply, until

WIDE, NARROW = (150, 45), (80, 24)
STATS = {"tau": 2.0, "decode_tokens_per_s": 30.0, "speculative": True, "rounds": 2,
         "drafted": 14, "accepted": 2, "accepted_per_round": [0, 1, 0, 1]}
CHUNKS = [chunk("One", [1], 0, 0), chunk(" two three", [2, 3, 4], 2, 1), chunk(" four", [5], 0, 2)]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_LOCAL_HOME", str(tmp_path))
    return tmp_path


def test_a_reply_served_from_the_disk_cache_says_so(home):
    async def scenario(app, pilot):
        usage = StreamUsage(40, 4, {**STATS, "cached_tier": "disk"}, cached_tokens=32)
        view = await streamed_reply(app, pilot, CHUNKS, "done", usage)
        assert "32 cached (disk)" in view.header
        figures = figures_text(app.chat_screen.query_one(SpeedPanel).snapshot).plain
        assert "32/40 prompt tokens cached" in figures and "from the disk cache" in figures
        again = await streamed_reply(app, pilot, CHUNKS, "done",
                                     StreamUsage(60, 4, {**STATS, "cached_tier": "ram"}, 48))
        assert "48 cached (ram)" in again.header
    run_offline(scenario, WIDE)


def test_a_streaming_reply_is_not_painted_again_when_nothing_changed(home, monkeypatch):
    async def scenario(app, pilot):
        view = await streamed_reply(app, pilot, CHUNKS, "done")
        view._paint_stream()  # everything rendered is painted once
        computed = []
        real = draft_colours.char_styles
        monkeypatch.setattr(draft_colours, "char_styles",
                            lambda *args: computed.append(1) or real(*args))
        for _ in range(3):  # the painter's ticks with nothing new
            view._paint_stream()
        assert computed == []
        await view.append(" five\n\nsix", [[10, 0, 2]])
        await view.body.update(view.text)
        await pilot.pause()
        view._paint_stream()  # new blocks: painted
        assert computed
    run_offline(scenario, WIDE)


def test_a_new_chats_first_send_writes_its_settings_once(home):
    async def scenario(app, pilot):
        writes = []
        store_write = app.store.set_chat_settings
        app.store.set_chat_settings = lambda *args: writes.append(args) or store_write(*args)
        app.chat_screen.query_one(PromptInput).value = "Hello"
        await pilot.press("enter")
        conversation = app.chat_screen.conversation
        await until(pilot, lambda: conversation.generating, "reply started")
        assert len(writes) == 1 and writes[0][0] == conversation.chat_id
        conversation.stop()
        await until(pilot, lambda: not conversation.generating, "reply stopped")
    run_offline(scenario, WIDE)


# --- the overflow policy, on its own (a count of words stands in for the tokenizer) ---

def history_of(turns: int, words: int = 10) -> list[HistoryMessage]:
    history = []
    for turn in range(turns):
        history.append(HistoryMessage(2 * turn + 1, "user", f"question {turn} " + "w " * words))
        history.append(HistoryMessage(2 * turn + 2, "assistant", f"answer {turn} " + "w " * words))
    return history


async def word_count(messages: list[dict]) -> int:
    return sum(len(message["content"].split()) + 2 for message in messages)


def fit(history, prompt="next question", context=300, max_tokens=50, policy="drop_oldest"):
    system = [{"role": "system", "content": "be brief"}]
    return asyncio.run(fit_history(word_count, system, history, prompt, context, max_tokens,
                                   policy))


def test_a_conversation_that_fits_is_sent_whole():
    result = fit(history_of(3))
    assert result.first_kept is None and result.dropped == 0
    assert result.tokens == asyncio.run(word_count(
        [{"role": "system", "content": "be brief"}] + [
            {"role": m.role, "content": m.content} for m in history_of(3)]
        + [{"role": "user", "content": "next question"}]))


def test_drop_oldest_cuts_whole_turns_to_below_the_trimmed_budget():
    history = history_of(40)  # 40 turns of 14 words a message: far past 250
    result = fit(history)
    budget = 300 - 50
    assert result.tokens <= budget * TRIM_TO
    kept = [m for m in history if m.id >= result.first_kept]
    assert kept[0].role == "user" and result.dropped == len(history) - len(kept)
    one_more = history[len(history) - len(kept) - 2:]  # a turn more would not fit the trim
    assert asyncio.run(word_count([{"role": "system", "content": "be brief"}] + [
        {"role": m.role, "content": m.content} for m in one_more]
        + [{"role": "user", "content": "next question"}])) > budget * TRIM_TO


def test_refuse_and_a_prompt_too_long_alone_say_by_how_much():
    with pytest.raises(ContextOverflow, match=r"would be \d+ tokens.*policy is refuse"):
        fit(history_of(40), policy="refuse")
    with pytest.raises(ContextOverflow, match=r"alone makes a prompt of \d+ tokens"):
        fit(history_of(2), prompt="word " * 400)
    with pytest.raises(ContextOverflow, match="alone"):
        fit([], prompt="word " * 400)


def test_the_meter_reads_tokens_over_the_context():
    assert meter_text(1234, 8192) == "ctx 1.2k/8.2k 15%"
    assert meter_text(None, 8192) == "" and meter_text(10, None) == ""
