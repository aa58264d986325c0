"""dflash-chat for long conversations (issue 51): the context meter and the overflow policy,
the prefix cache's tier in a reply's figures, and what a streaming reply and a first send
cost; driven through Pilot with no service (a reply's chunks arrive as its worker posts them)."""

from __future__ import annotations

import asyncio

import pytest
from dflash_chat.context_fit import (
    SUMMARY_HEAD,
    SUMMARY_TOKENS,
    TRIM_TO,
    ContextOverflow,
    HistoryMessage,
    fit_history,
    meter_text,
    summary_request,
    with_summary,
)
from dflash_chat.protocol import StreamUsage
from dflash_chat.storage import DB_NAME, ChatStore
from dflash_chat.widgets import draft_colours
from dflash_chat.widgets.conversation import Conversation
from dflash_chat.widgets.prompt_input import PromptInput
from dflash_chat.widgets.speed_panel import SpeedPanel, figures_text
from tui_support import chunk, run_offline, screen_lines, serve_pair, streamed_reply, until

WIDE, NARROW = (150, 45), (80, 24)
STATS = {"tau": 2.0, "decode_tokens_per_s": 30.0, "speculative": True, "rounds": 2,
         "drafted": 14, "accepted": 2, "accepted_per_round": [0, 1, 0, 1]}
CHUNKS = [chunk("One", [1], 0, 0), chunk(" two three", [2, 3, 4], 2, 1), chunk(" four", [5], 0, 2)]


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


def fit(history, prompt="next question", context=300, max_tokens=50, policy="drop_oldest",
        keep_turns=8):
    system = [{"role": "system", "content": "be brief"}]
    return asyncio.run(fit_history(word_count, system, history, prompt, context, max_tokens,
                                   policy, keep_turns))


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


def test_keep_last_sends_the_last_n_turns_or_fewer_where_those_do_not_fit():
    history = history_of(40)
    kept_turns = fit(history, policy="keep_last", keep_turns=3)
    assert kept_turns.first_kept == history[-6].id and kept_turns.dropped == len(history) - 6
    assert fit(history_of(3), policy="keep_last", keep_turns=3).first_kept is None  # it fits
    narrow = fit(history, policy="keep_last", keep_turns=20)  # 20 turns are past the budget
    kept = [m for m in history if m.id >= narrow.first_kept]
    assert kept[0].role == "user" and len(kept) < 40 and narrow.tokens <= 300 - 50
    assert fit(history, policy="drop_oldest").first_kept != narrow.first_kept  # no trim below


def test_the_open_chats_policy_cycles_and_keep_turns_is_a_chat_value(home):
    async def scenario(app, pilot):
        seen = []
        for _ in range(4):
            app.chat_screen.action_toggle_overflow()
            seen.append(app.settings.overflow)
        assert seen == ["refuse", "keep_last", "summarise", "drop_oldest"]
        app.chat_screen.action_toggle_overflow()
        app.chat_screen.action_toggle_overflow()
        await pilot.pause()
        assert "the last 8 turns" in "\n".join(str(n.message) for n in app._notifications)
        assert app.chat_settings()["overflow"] == "keep_last"
        assert app.chat_settings()["keep_turns"] == 8 and app.defaults.overflow == "drop_oldest"
    run_offline(scenario, WIDE, toasts=True)


def test_summarise_keeps_room_for_the_summary_and_asks_from_the_cached_start():
    history = history_of(40)
    dropped, summarised = fit(history), fit(history, policy="summarise")
    assert summarised.dropped > dropped.dropped  # the summary's room left out one more turn
    assert summarised.tokens <= 300 - 50 - SUMMARY_TOKENS
    system = [{"role": "system", "content": "be brief"}]
    asked = asyncio.run(summary_request(word_count, system, history[:summarised.dropped], 2000))
    sent_before = system + [{"role": m.role, "content": m.content} for m in history]
    assert asked[:-1] == sent_before[:len(asked) - 1]  # the last request's start, then the ask
    short = asyncio.run(summary_request(word_count, system, history[:summarised.dropped], 600))
    assert short[1]["role"] == "user" and len(short) < len(asked)  # oldest turns out, to fit
    assert asyncio.run(summary_request(word_count, system, history[:2], 100)) is None
    assert with_summary(system, "they counted") == [
        {"role": "system", "content": "be brief\n\n" + SUMMARY_HEAD + "they counted"}]
    assert with_summary([], "") == []


def test_a_summary_request_bisects_the_turns_it_keeps():
    """The first turn kept is bisected: log2(turns) counts, not one for each turn left out."""
    system, history, counts = [{"role": "system", "content": "be brief"}], history_of(40), []

    async def counted(messages: list[dict]) -> int:
        counts.append(messages)
        return await word_count(messages)

    asked = asyncio.run(summary_request(counted, system, history, 400))
    kept = len(asked) - 2  # less the system message and the ask
    assert asked[1]["role"] == "user" and 0 < kept < len(history) - 2
    longer = system + [{"role": m.role, "content": m.content} for m in history[-kept - 2:]]
    assert asyncio.run(word_count(asked)) <= 400 - SUMMARY_TOKENS  # it fits...
    assert asyncio.run(word_count(longer + asked[-1:])) > 400 - SUMMARY_TOKENS  # ...one more not
    assert len(counts) <= 7  # ceil(log2(40 turns)) + 1


def test_an_existing_summary_is_replaced_not_kept_beside_the_new_ones_room():
    """A cut sends a new summary in place of the old: the old one is counted only where the
    history is sent whole, and the room kept for a summary is kept once."""
    history, system = history_of(40), [{"role": "system", "content": "be brief"}]
    old = "earlier they counted " * 20

    def fit_with(summary: str, turns=history):
        return asyncio.run(fit_history(word_count, system, turns, "next question", 300, 50,
                                       "summarise", summary=summary))

    assert fit_with(old).dropped == fit_with("").dropped
    assert fit_with(old).tokens <= 300 - 50 - SUMMARY_TOKENS
    whole = fit_with("", history_of(4))  # fits whole without the old summary, not with it
    assert whole.first_kept is None and fit_with(old * 3, history_of(4)).first_kept is not None


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


# --- branches: regenerate and edit keep the earlier versions ---

async def reply_posted(app, pilot, text: str) -> None:
    """The reply started (Enter, Ctrl+R) gets its chunks and its end, as its worker posts them."""
    conversation = app.chat_screen.conversation
    await until(pilot, lambda: conversation.generating, "reply started")
    reply_id = conversation.last_view("assistant").message_id
    conversation.post_message(Conversation.ChunksArrived(reply_id, [chunk(text, [1, 2], 1, 1)]))
    conversation.post_message(Conversation.StreamEnded(reply_id, "done", None, None))
    await until(pilot, lambda: not conversation.generating, "reply ended")
    await pilot.pause()


def shown(app) -> list[str]:
    return [view.text for view in app.chat_screen.conversation.views()]


def test_regenerate_and_edit_keep_the_earlier_versions_across_a_restart(home):
    store = ChatStore(home / DB_NAME)
    chat = store.create_chat("Branches")
    for turn in range(3):
        store.add_message(chat.id, "user", f"prompt {turn}")
        store.add_message(chat.id, "assistant", f"reply {turn}")
    store.close()

    async def first_run(app, pilot):
        conversation = app.chat_screen.conversation
        await pilot.press("ctrl+r")
        await reply_posted(app, pilot, "reply 2, again")
        assert shown(app)[-2:] == ["prompt 2", "reply 2, again"]
        newest = conversation.last_view("assistant")
        assert "version 2/2" in newest._header_text()
        newest.focus()
        await pilot.press("left")  # the earlier reply, shown again
        await until(pilot, lambda: shown(app)[-1] == "reply 2", "version 1 shown")
        assert "version 1/2" in conversation.last_view("assistant")._header_text()
        conversation.views()[2].focus()  # "prompt 1": edit it, a fork at message 3
        await pilot.press("ctrl+o")
        prompt = app.chat_screen.query_one(PromptInput)
        assert prompt.value == "prompt 1"
        prompt.value = "prompt 1, edited"
        await pilot.press("enter")
        await reply_posted(app, pilot, "reply 1, edited")
        assert shown(app) == ["prompt 0", "reply 0", "prompt 1, edited", "reply 1, edited"]
        assert "version 2/2" in conversation.views()[2]._header_text()
        await pilot.press("f9")
        exported = (home / "exports" / f"chat-{chat.id}.md").read_text()
        assert "prompt 1, edited" in exported and "# Another version, after: reply 0" in exported
        assert "reply 2, again" in exported and "reply 2\n" in exported
    run_offline(scenario=first_run, size=WIDE)

    async def after_restart(app, pilot):  # both branches stored, the last one shown
        conversation = app.chat_screen.conversation
        assert shown(app) == ["prompt 0", "reply 0", "prompt 1, edited", "reply 1, edited"]
        conversation.views()[2].focus()
        await pilot.press("right")  # wraps round to the first version of prompt 1
        await until(pilot, lambda: len(shown(app)) == 6, "the first branch shown")
        assert shown(app)[2:4] == ["prompt 1", "reply 1"] and shown(app)[-1] == "reply 2, again"
    run_offline(scenario=after_restart, size=WIDE)


def test_a_store_from_before_branches_reads_as_one_branch(tmp_path):
    import sqlite3

    from dflash_chat.storage_schema import SCHEMA

    path = tmp_path / DB_NAME
    old = sqlite3.connect(path)
    old.executescript(SCHEMA)  # no parents, no head, no context start
    old.execute("INSERT INTO chats (id, title, created, updated) VALUES (1, 'Old', 0, 0)")
    for index, role in enumerate(("user", "assistant", "user", "assistant")):
        old.execute("INSERT INTO messages (chat_id, role, content, created) VALUES (1, ?, ?, 0)",
                    (role, f"message {index}"))
    old.commit()
    old.close()
    store = ChatStore(path)
    messages = store.messages(1)
    assert [m.content for m in messages] == [f"message {i}" for i in range(4)]
    assert [m.parent_id for m in messages] == [None] + [m.id for m in messages[:-1]]
    assert store.versions(1) == {} and store.chat(1).context_from == 0
    again = store.add_message(1, "assistant", "message 3, again", parent=messages[2].id)
    assert store.versions(1) == {messages[3].id: (1, 2), again.id: (2, 2)}
    store.delete_messages_from(1, messages[2].id)  # a message and what follows, every branch
    assert [m.content for m in store.messages(1)] == ["message 0", "message 1"]
    assert store.search("again") == [] and len(store.all_messages(1)) == 2


# --- presets: the user's named values, applied per chat ---

def test_a_preset_saved_from_one_chat_applies_to_another_and_leaves_the_defaults(home):
    from dflash_chat.screens.presets import PresetScreen

    async def save_and_apply(app, pilot):
        screen = app.chat_screen
        await screen._open_new_chat("Precise")
        app.store.set_system_prompt(screen.conversation.chat_id, "Answer in one line.")
        screen._set_chat_value(temperature=0.3, max_tokens=99, overflow="refuse")
        await pilot.press("alt+p")
        assert isinstance(app.screen, PresetScreen)
        await pilot.press("enter")  # the first line: save this chat's values
        await pilot.press(*"terse", "enter")
        (preset,) = app.store.presets()
        assert preset.name == "terse" and preset.system_prompt == "Answer in one line."
        assert (preset.settings["temperature"], preset.settings["overflow"]) == (0.3, "refuse")
        await pilot.press("ctrl+n")
        assert app.settings.temperature == 0.0 and app.settings.overflow == "drop_oldest"
        await pilot.press("alt+p", "down", "enter")  # the preset, on no chat yet: a new one
        await until(pilot, lambda: app.settings.max_tokens == 99, "the preset applied")
        chat = app.store.chat(screen.conversation.chat_id)
        assert chat.system_prompt == "Answer in one line." and chat.settings["temperature"] == 0.3
        assert app.defaults.temperature == 0.0 and app.defaults.overflow == "drop_oldest"
    run_offline(save_and_apply, WIDE)

    async def delete_after_restart(app, pilot):
        await pilot.press("alt+p", "down", "delete")
        assert app.store.presets() == []
    run_offline(delete_after_restart, WIDE)


def test_a_preset_keeps_its_pair_and_applying_it_loads_that_pair_through_the_picker(home):
    from dflash_chat.screens.picker import PickerScreen
    from textual.widgets import Static

    async def scenario(app, pilot):
        serve_pair(app, "pair-a")
        asked: list[str] = []

        class Service:  # a load, and the status after it
            async def load_pair(self, pair_id):
                asked.append(pair_id)
                return {}

            async def status(self):
                return {"loaded": {"pair": asked[-1], "served_name": asked[-1],
                                   "engine": "transformers"}}

            async def aclose(self):
                pass
        app.client = Service()
        await pilot.press("alt+p", "enter", *"on a", "enter")  # saved while pair-a is loaded
        (preset,) = app.store.presets()
        assert preset.settings["pair"] == "pair-a"
        await pilot.press("alt+p", "down", "enter")  # pair-a loaded: nothing to load
        await pilot.pause()
        assert not isinstance(app.screen, PickerScreen)
        serve_pair(app, "pair-b")
        await pilot.press("alt+p", "down", "enter")
        await until(pilot, lambda: isinstance(app.screen, PickerScreen), "the picker opened")
        picker = app.screen
        rows = [{**row, "loaded": row["id"] == "pair-b"} for row in catalog_rows()[:2]]
        rows[0]["id"], rows[1]["id"] = "pair-a", "pair-b"
        picker.post_message(PickerScreen.Listed(rows, {}))
        await until(pilot, lambda: app.chat_settings()["pair"] == "pair-a", "pair-a loaded")
        assert asked == ["pair-a"]  # as `l` in the picker loads it
        gone = PickerScreen(load_when_listed="pair-c")  # a pair this service does not list
        await app.push_screen(gone)
        gone.post_message(PickerScreen.Listed(rows, {}))
        message = gone.query_one("#message", Static)
        await until(pilot, lambda: "pair-c is not in" in str(message.render()), "said why not")
        assert asked == ["pair-a"]
    run_offline(scenario, WIDE)


# --- the lesser defects: the picker, F1 ---

def catalog_rows() -> list[dict]:
    from dflash_local.pairs.catalog import load_catalog

    return [{**pair.to_json(), "available": {}, "loaded": index == 0, "fit": {}}
            for index, pair in enumerate(load_catalog().pairs)]


def test_the_picker_shows_whole_ids_says_what_it_shows_and_keeps_the_loaded_pair(home):
    from dflash_chat.screens.picker import PickerScreen
    from textual.widgets import DataTable, Static

    async def scenario(app, pilot):
        pairs = catalog_rows()
        picker = PickerScreen()
        await app.push_screen(picker)
        picker.post_message(PickerScreen.Listed(pairs, {}))
        await until(pilot, lambda: picker.query_one(DataTable).row_count == len(pairs), "listed")
        await pilot.pause()
        text = "\n".join(screen_lines(app))
        assert "Loaded" in text.splitlines()[1]
        assert all(pair["id"] in text for pair in pairs[:20])  # rows on screen, ids whole
        await pilot.press("l")  # the first row is the loaded pair
        assert "already loaded" in "\n".join(str(n.message) for n in app._notifications)
        assert not app.service_state.startswith("loading")
        picker.download_pair = pairs[0]["id"]
        picker.post_message(PickerScreen.Progress({"id": "d1", "label": pairs[0]["id"],
                                                   "status": "failed", "error": "disk full"}))
        status = picker.query_one("#download-status", Static)
        await until(pilot, lambda: "disk full" in str(status.render()), "the failure shown")
        await pilot.press("down")
        assert not status.display  # not under another pair
        await pilot.press("up")
        assert status.display
    run_offline(scenario, WIDE)


def test_f1_shows_every_action_id_whole_at_80_columns(home):
    from dflash_chat.actions import ACTIONS

    async def scenario(app, pilot):
        await pilot.press("f1")
        await pilot.pause()
        text = "\n".join(screen_lines(app))
        shown = [spec.id for spec in ACTIONS[:8]]  # the rows above the fold at 24 lines
        assert all(f" {action_id} " in text for action_id in shown)
    run_offline(scenario, NARROW)


def test_search_highlights_the_words_found_and_keeps_the_texts_own_brackets(home):
    from dflash_chat.screens.search import hit_label

    store = ChatStore(home / DB_NAME)
    chat = store.create_chat("Indexing")
    store.add_message(chat.id, "user", "why does items[0] fail on an empty list")
    (hit,) = store.search("empty")
    label = hit_label(hit)
    assert "items[0] fail on an empty" in label.plain and "[empty]" not in label.plain
    highlighted = [label.plain[span.start:span.end] for span in label.spans
                   if "reverse" in str(span.style)]
    assert highlighted == ["empty"]


def test_chats_that_begin_alike_get_titles_told_apart(home):
    async def scenario(app, pilot):
        prompt = app.chat_screen.query_one(PromptInput)
        conversation = app.chat_screen.conversation
        for _ in range(3):
            await pilot.press("ctrl+n")
            prompt.value = "Write a poem."
            await pilot.press("enter")
            await until(pilot, lambda: conversation.generating, "sent")
            conversation.stop()
            await until(pilot, lambda: not conversation.generating, "stopped")
        titles = sorted(chat.title for chat in app.store.chats())
        assert titles == ["Write a poem.", "Write a poem. (2)", "Write a poem. (3)"]
    run_offline(scenario, WIDE)


def test_the_delete_dialog_fits_80_columns_and_the_chat_comes_back(home):
    title = "A chat with a rather long title that goes on and on about many things"
    store = ChatStore(home / DB_NAME)
    chat = store.create_chat(title)
    store.add_message(chat.id, "user", "first")
    store.add_message(chat.id, "assistant", "one")
    store.add_message(chat.id, "assistant", "another", parent=store.messages(chat.id)[0].id)
    store.set_chat_settings(chat.id, {"temperature": 0.4})
    store.close()

    async def scenario(app, pilot):
        await pilot.press("ctrl+g")
        text = " ".join(line.strip(" █") for line in screen_lines(app))
        assert "goes on and on about many things'?" in " ".join(text.split())
        await pilot.press("y")
        await until(pilot, lambda: app.store.chats() == [], "deleted")
        await pilot.press("alt+z")
        await until(pilot, lambda: len(app.store.chats()) == 1, "restored")
        (back,) = app.store.chats()
        assert back.title == title and back.settings == {"temperature": 0.4}
        assert [m.content for m in app.store.messages(back.id)] == ["first", "another"]
        assert len(app.store.versions(back.id)) == 2
        await until(pilot, lambda: app.chat_screen.conversation.chat_id == back.id, "opened")
    run_offline(scenario, NARROW)


def test_a_selected_message_is_deleted_with_what_follows_it_in_every_branch(home):
    store = ChatStore(home / DB_NAME)
    chat = store.create_chat("Pruned")
    first = store.add_message(chat.id, "user", "keep me")
    store.add_message(chat.id, "assistant", "kept")
    asked = store.add_message(chat.id, "user", "drop me")
    store.add_message(chat.id, "assistant", "dropped, once")
    store.add_message(chat.id, "assistant", "dropped, again", parent=asked.id)
    store.close()

    async def scenario(app, pilot):
        conversation = app.chat_screen.conversation
        conversation.views()[2].focus()
        await pilot.press("alt+d")
        assert "the 2 that follow it" in " ".join(" ".join(screen_lines(app)).split())
        await pilot.press("y")
        await until(pilot, lambda: shown(app) == ["keep me", "kept"], "deleted")
        assert [m.content for m in app.store.all_messages(first.chat_id)] == ["keep me", "kept"]
    run_offline(scenario, WIDE)


def test_a_search_hit_in_another_branch_opens_that_branch(home):
    store = ChatStore(home / DB_NAME)
    chat = store.create_chat("Two answers")
    asked = store.add_message(chat.id, "user", "name a colour")
    store.add_message(chat.id, "assistant", "turquoise")
    store.add_message(chat.id, "assistant", "crimson", parent=asked.id)  # the branch shown
    store.close()

    async def scenario(app, pilot):
        assert shown(app) == ["name a colour", "crimson"]
        await pilot.press("ctrl+f", *"turquo", "enter")
        await until(pilot, lambda: shown(app) == ["name a colour", "turquoise"], "its branch")
    run_offline(scenario, WIDE)
