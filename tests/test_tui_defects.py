"""dflash-chat as a new user met it: each test here is one defect of issue 35 (pastes, Markdown,
settings focus, palette hints, a failed download, stale numbers, max tokens, titles and search,
80x24, a refused prompt, thinking on a model without it), driven through Pilot with no service:
a reply's chunks arrive as the reply worker posts them."""

from __future__ import annotations

import os
import sys
import time

import pytest
from dflash_chat.protocol import StreamUsage
from dflash_chat.screens.picker import PickerScreen
from dflash_chat.screens.search import SearchScreen
from dflash_chat.screens.settings import SettingsScreen
from dflash_chat.settings import Settings
from dflash_chat.storage import DB_NAME, ChatStore
from dflash_chat.widgets.conversation import Conversation
from dflash_chat.widgets.draft_colours import DRAFT_STYLE
from dflash_chat.widgets.prompt_input import PromptInput
from dflash_chat.widgets.speed_panel import SpeedPanel, figures_text, speculation_text
from dflash_chat.widgets.status_bar import StatusBar
from textual import events
from textual.command import CommandList, CommandPalette
from textual.widgets import Input, Markdown, ProgressBar
from textual.widgets.markdown import MarkdownBlock, MarkdownFence
from tui_support import chunk, run_offline, serve_pair, streamed_reply, until

WIDE, NARROW = (150, 45), (80, 24)
REPLY = "Like this:\n\n```python\nprint('hi')\n```\n"
ROUNDS = [[10, 6, 7], [12, 3, 4], [len(REPLY) - 22, 2, 3]]
STATS = {"tau": 3.5, "decode_tokens_per_s": 42.0, "speculative": True, "completion_tokens": 14,
         "rounds": 4, "drafted": 28, "accepted": 11, "accepted_per_round": [0, 1, 0, 2, 1]}


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_LOCAL_HOME", str(tmp_path))
    store = ChatStore(tmp_path / DB_NAME)
    chat = store.create_chat("Greeting")
    store.add_message(chat.id, "user", "How do I print?")
    store.add_message(chat.id, "assistant", REPLY, meta={"speculative": True, "rounds": ROUNDS,
                                                          "stats": STATS})
    store.close()
    return tmp_path


def run(scenario, size=WIDE, settings: Settings | None = None) -> None:
    run_offline(scenario, size, settings)


def notices(app) -> str:
    return "\n".join(str(n.message) for n in app._notifications)


# 1. a pasted multi-line prompt keeps only its first line (with bracketed paste, and without:
#    then the terminal types the line breaks as Enter keys, straight after each other)
def test_a_pasted_prompt_arrives_whole_and_ctrl_j_starts_a_line(home):
    async def scenario(app, pilot):
        prompt = app.chat_screen.query_one(PromptInput)
        app.post_message(events.Paste("def f():\n    return 1\nprint(f())"))  # as a terminal
        await pilot.pause()
        await pilot.press("ctrl+j", *"why?")
        assert prompt.value == "def f():\n    return 1\nprint(f())\nwhy?"
        await pilot.press("enter")
        await until(pilot, lambda: app.chat_screen.conversation.generating, "sent")
        chat_id = app.chat_screen.conversation.chat_id
        user = [m for m in app.store.messages(chat_id) if m.role == "user"][-1]
        assert user.content == "def f():\n    return 1\nprint(f())\nwhy?"
        assert prompt.value == ""
    run(scenario)


def test_a_paste_typed_as_keys_keeps_its_line_breaks(home):
    async def scenario(app, pilot):
        prompt = app.chat_screen.query_one(PromptInput)
        for char in "one\rtwo\rthree":  # one read from the terminal: all queued at once
            key = "enter" if char == "\r" else char
            app.post_message(events.Key(key, char))
        await until(pilot, lambda: prompt.value == "one\ntwo\nthree", "pasted")
        await pilot.press("enter")  # nothing follows: it sends
        await until(pilot, lambda: app.chat_screen.conversation.generating, "sent")
        assert app.chat_screen.conversation.last_view("user").text == "one\ntwo\nthree"
    run(scenario)


# 2. Markdown is not rendered by default (colouring replaced it with raw text)
def test_markdown_is_rendered_with_the_draft_colours_on_it(home):
    async def scenario(app, pilot):
        assert app.settings.show_accepted  # the default
        view = app.chat_screen.conversation.last_view("assistant")
        await until(pilot, lambda: bool(view.query(MarkdownFence)), "rendered")
        fence = view.query_one(MarkdownFence)
        assert fence.display and view.query_one(Markdown).display and fence.region.height > 0
        assert not any("```" in block._content.plain for block in view.query(MarkdownBlock))
        painted = [span for block in view.query(MarkdownBlock) for span in block._content.spans
                   if str(span.style) == DRAFT_STYLE]
        assert painted  # the drafter's tokens, green on the rendered text
        await pilot.press("f3")  # colours off: still rendered, no paint
        await until(pilot, lambda: bool(view.query(MarkdownFence)), "rendered again")
        await pilot.pause()
        assert not [span for block in view.query(MarkdownBlock) for span in block._content.spans
                    if str(span.style) == DRAFT_STYLE]
    run(scenario)


def test_a_streaming_reply_is_painted_as_it_renders(home):
    async def scenario(app, pilot):
        screen = app.chat_screen
        screen.query_one(PromptInput).value = "Show code."
        await pilot.press("enter")
        conversation = screen.conversation
        await until(pilot, lambda: conversation.generating, "reply started")
        view = conversation.last_view("assistant")
        text = "Here:\n\n```python\nprint('hi')\n```\n"
        chunks = [chunk(text[:6], [1], 0, 0), chunk(text[6:], [2, 3, 4, 5], 3, 1)]
        conversation.post_message(Conversation.ChunksArrived(view.message_id, chunks))

        def painted() -> bool:
            return any(str(span.style) == DRAFT_STYLE for fence in view.query(MarkdownFence)
                       for span in fence._content.spans)

        await until(pilot, painted, "the streaming code block painted")
        assert conversation.generating  # still streaming
    run(scenario)


# 3. settings: nothing focused, "saved" with nothing changed, the refusal off screen
def test_settings_focus_a_field_and_show_a_refusal_on_screen(home):
    async def scenario(app, pilot):
        await pilot.press("f6")
        screen = app.screen
        assert isinstance(screen, SettingsScreen)
        assert isinstance(app.focused, Input) and app.focused.id == "num-temperature"
        await pilot.press("ctrl+s")
        assert "Nothing changed" in notices(app) and "Settings saved" not in notices(app)
        await pilot.press("f6")
        await pilot.press("end", "backspace", "backspace", "backspace", *"hot")
        await pilot.press("ctrl+s")
        await pilot.pause()
        problems = app.screen.query_one("#problems")
        assert problems.display and "Temperature" in str(problems.render())
        assert 0 <= problems.region.y and problems.region.bottom <= NARROW[1]
        assert problems.region.height > 0
    run(scenario, size=NARROW)


# 4. the palette drops key hints that look like markup
def test_the_palette_shows_each_actions_keys(home):
    async def scenario(app, pilot):
        await pilot.press("ctrl+p")
        await until(pilot, lambda: isinstance(app.screen, CommandPalette), "palette")
        await pilot.press(*"race")
        hits = app.screen.query_one(CommandList)
        await until(pilot, lambda: hits.option_count > 0, "palette hits")
        shown = [str(hits.get_option_at_index(i).prompt) for i in range(hits.option_count)]
        assert any("Race" in line and "[f4]" in line for line in shown), shown
    run(scenario)


# 5. a failed download looks alive, and `c` says nothing
def test_a_failed_download_stops_its_bar_and_cancel_answers(home):
    async def scenario(app, pilot):
        picker = PickerScreen()
        await app.push_screen(picker)
        picker.post_message(PickerScreen.Progress(
            {"id": "d1", "label": "qwen3-8b", "status": "running", "bytes_done": 0}))
        await pilot.pause()
        assert picker.query_one(ProgressBar).display
        picker.post_message(PickerScreen.Progress(
            {"id": "d1", "label": "qwen3-8b", "status": "failed", "bytes_done": 0,
             "error": "HTTP 404 for Qwen/Qwen3-8B"}))
        await pilot.pause()
        assert not picker.query_one(ProgressBar).display
        assert "HTTP 404" in str(picker.query_one("#download-status").render())
        await pilot.press("c")
        assert "nothing to cancel" in notices(app)
    run(scenario)


# 7. stale numbers: the panel belongs to the reply it describes
def test_the_speed_panel_follows_the_reply_and_resets(home):
    async def scenario(app, pilot):
        panel = app.chat_screen.query_one(SpeedPanel)
        assert panel.snapshot.final and panel.snapshot.tau == 3.5  # this chat's last reply
        await pilot.press("ctrl+n")
        assert not panel.snapshot.final and not panel.snapshot.live
        assert "no reply yet" in figures_text(panel.snapshot).plain
        app.chat_screen.query_one(PromptInput).value = "Hello"
        await pilot.press("enter")  # no service: the reply waits for its first token
        await until(pilot, lambda: app.chat_screen.conversation.generating, "sent")
        assert panel.snapshot.waiting
        assert "B=1" not in speculation_text(panel.snapshot).plain
        assert "tau" not in speculation_text(panel.snapshot).plain
    run(scenario)


def test_selecting_a_reply_shows_its_figures(home):
    async def scenario(app, pilot):
        first = app.chat_screen.conversation.last_view("assistant")
        view = await streamed_reply(app, pilot, [chunk("One two", [1, 2, 3], 2, 1)], "done",
                                    StreamUsage(5, 3, {**STATS, "tau": 3.0, "rounds": 1}))
        panel = app.chat_screen.query_one(SpeedPanel)
        assert panel.snapshot.tau == 3.0
        first.focus()
        await pilot.pause()
        assert panel.snapshot.tau == 3.5
        view.focus()
        await pilot.pause()
        assert panel.snapshot.tau == 3.0
    run(scenario)


def test_a_stopped_reply_keeps_its_figures(home):
    async def scenario(app, pilot):
        chunks = [chunk("One", [1], 0, 0), chunk(" two three", [2, 3, 4], 2, 1),
                  chunk(" four", [5, 6], 1, 2)]
        view = await streamed_reply(app, pilot, chunks, "stopped")  # Esc: no service totals
        assert "tau 2.50" in view.header and "tok/s" in view.header and "stopped" in view.header
        stored = app.store.message(view.message_id)
        assert stored.meta["stats"]["tau"] == 2.5 and stored.meta["stats"]["completion_tokens"] == 6
        panel = app.chat_screen.query_one(SpeedPanel).snapshot
        assert panel.final and panel.tokens == 6 and panel.tokens_per_s_now == 0.0
    run(scenario)


# 8. a reply cut at max tokens has no marker
def test_a_reply_cut_at_max_tokens_says_so(home):
    async def scenario(app, pilot):
        lines = [f"Line {i} of a long answer." for i in range(30)]  # well past the fold
        chunks = [chunk("One", [1], 0, 0)]
        chunks += [chunk(f"\n\n{line}", [i, i + 1], 1, i + 1) for i, line in enumerate(lines)]
        chunks.append(chunk(" two", [2, 3], 1, 99, finish="length"))
        usage = StreamUsage(5, 3, {**STATS, "prefill_s": 0.02},
                            cached_tokens=4)
        view = await streamed_reply(app, pilot, chunks, "done", usage)
        assert "max tokens reached" in view.header
        meta = app.store.message(view.message_id).meta  # kept once, with the figures
        assert meta["stats"]["finish_reason"] == "length" and "finish_reason" not in meta
        figures = figures_text(app.chat_screen.query_one(SpeedPanel).snapshot).plain
        assert "max tokens reached" in figures and "4/5 prompt tokens cached" in figures
        assert "ms to first token" in figures and "-" not in figures.split("ms to first")[0][-9:]
        await pilot.pause()
        conversation = app.chat_screen.conversation
        assert conversation.max_scroll_y > 0 and conversation.scroll_y == conversation.max_scroll_y
    run(scenario, size=NARROW)


# 9. chats can't be told apart: titles cut, no date, no search
def test_titles_are_first_lines_with_dates_and_chats_are_searchable(home):
    async def scenario(app, pilot):
        await pilot.press("ctrl+n")
        prompt = app.chat_screen.query_one(PromptInput)
        prompt.value = "Explain the difference between processes and threads\nwith examples"
        await pilot.press("enter")
        await until(pilot, lambda: app.chat_screen.conversation.generating, "sent")
        chat = app.store.chat(app.chat_screen.conversation.chat_id)
        assert chat.title == "Explain the difference between processes and threads"
        label = app.chat_screen.query_one("#chats").get_option_at_index(0).prompt
        assert time.strftime("%Y-%m-%d", time.localtime(chat.created)) in str(label)
        assert chat.settings["max_tokens"] == app.settings.max_tokens  # kept with the chat
        app.chat_screen.conversation.stop()
        await until(pilot, lambda: not app.chat_screen.conversation.generating, "stopped")
        await pilot.press("ctrl+f")
        assert isinstance(app.screen, SearchScreen)
        await pilot.press(*"prin")  # a word prefix of "print"
        hits = app.screen.query_one("#search-hits")
        assert hits.option_count == 1 and "Greeting" in str(hits.get_option_at_index(0).prompt)
        await pilot.press("enter")
        await pilot.pause()
        assert app.store.chat(app.chat_screen.conversation.chat_id).title == "Greeting"
    run(scenario)


# 10. at 80x24 the side panels keep their width
def test_narrow_terminals_collapse_the_side_panels(home):
    async def scenario(app, pilot):
        screen = app.chat_screen
        chats, speed = screen.query_one("#chats"), screen.query_one("#speed")
        assert not chats.display and not speed.display
        assert screen.conversation.region.width >= 76
        await pilot.press("ctrl+l")
        assert chats.display and chats.region.width > 0
        await pilot.pause()
        assert app.focused is chats
        await pilot.press("ctrl+l", "ctrl+backslash")
        assert not chats.display and speed.display
        await pilot.press("ctrl+backslash", "ctrl+l")
        await pilot.pause()
        await pilot.press("enter")  # picks the highlighted chat: the list steps aside
        await pilot.pause()
        assert not chats.display and isinstance(app.focused, PromptInput)
    run(scenario, size=NARROW)


# 11. a prompt refused while a reply streams is cleared
def test_a_prompt_refused_while_streaming_is_kept(home):
    async def scenario(app, pilot):
        prompt = app.chat_screen.query_one(PromptInput)
        prompt.value = "first"
        await pilot.press("enter")
        await until(pilot, lambda: app.chat_screen.conversation.generating, "streaming")
        prompt.value = "second, typed meanwhile"
        await pilot.press("enter")
        await until(pilot, lambda: "Esc stops it" in notices(app), "refused")
        assert prompt.value == "second, typed meanwhile"
    run(scenario)


# 12. thinking can be switched on for a model that has none
def test_thinking_on_for_a_model_without_it_is_pointed_out(home):
    async def scenario(app, pilot):
        serve_pair(app, "embedded", thinking="none")
        await pilot.press("ctrl+t")  # auto -> on
        assert "no thinking mode" in app.chat_screen.query_one(StatusBar).warning
        assert "no thinking mode" in notices(app)
    run(scenario)


def test_edit_in_editor_and_attach_a_file(home, tmp_path, monkeypatch):
    editor = tmp_path / "editor.py"
    editor.write_text("import sys\nopen(sys.argv[1], 'a').write(' and more\\n')\n")
    monkeypatch.setenv("VISUAL", f"{sys.executable} {editor}")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("line A\nline B\n")

    async def scenario(app, pilot):
        prompt = app.chat_screen.query_one(PromptInput)
        prompt.value = "Summarise @notes.txt"
        await pilot.press("ctrl+e")
        assert prompt.value == "Summarise @notes.txt and more"
        await pilot.press("enter")
        await until(pilot, lambda: app.chat_screen.conversation.generating, "sent")
        user = app.chat_screen.conversation.last_view("user")
        assert user.text.startswith("Summarise @notes.txt and more")
        assert "```\nline A\nline B\n```" in user.text
    run(scenario)
    assert os.environ["VISUAL"].endswith("editor.py")


def test_a_chat_brings_back_the_settings_it_was_sent_with(home):
    store = ChatStore(home / DB_NAME)
    chat = store.create_chat("Creative")
    store.add_message(chat.id, "user", "Write a poem.")
    store.set_chat_settings(chat.id, {"pair": "qwen3-4b", "temperature": 0.9, "max_tokens": 64,
                                      "speculative": False})
    store.close()

    async def scenario(app, pilot):
        assert app.chat_screen.conversation.chat_id == chat.id  # the newest chat opens first
        assert (app.settings.temperature, app.settings.max_tokens) == (0.9, 64)
        assert not app.settings.speculative and not app.chat_screen.query_one(StatusBar).speculative
        serve_pair(app, "embedded")
        await app.chat_screen.open_chat(chat.id)  # now the service has said what is loaded
        await pilot.pause()
        assert "written with qwen3-4b; embedded is loaded" in notices(app)
    run(scenario)
