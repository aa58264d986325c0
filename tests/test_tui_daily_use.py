"""dflash-chat as a person who uses it every day met it: each test here is one defect of issue 51
(defaults rewritten by opening a chat, the user's prompt as Markdown, copy code on a cut reply,
no live speed when narrow, a dead service's toast, the draft colours, the first start's waits),
driven through Pilot with no service: a reply's chunks arrive as the reply worker posts them."""

from __future__ import annotations

import asyncio
import os
import re
import sys
import tomllib

import pytest
from dflash_chat.screens.search import SearchScreen
from dflash_chat.service import ServiceProcess
from dflash_chat.settings import Settings, save_settings
from dflash_chat.storage import DB_NAME, ChatStore
from dflash_chat.widgets.conversation import Conversation
from dflash_chat.widgets.prompt_input import PromptInput
from dflash_chat.widgets.speed_panel import SpeedPanel
from dflash_chat.widgets.status_bar import StatusBar
from tui_support import chunk, run_offline, screen_lines, streamed_reply, until

WIDE, NARROW = (150, 45), (80, 24)
REPLY = "Like this:\n\n```python\nprint('hi')\n```\n"


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A user's data dir: saved defaults (temperature 0.7, speculative), an older chat sent greedy
    and plain, and a newer one that opens first."""
    monkeypatch.setenv("DFLASH_LOCAL_HOME", str(tmp_path))
    save_settings(Settings(temperature=0.7, max_tokens=256), settings_file(tmp_path))
    store = ChatStore(tmp_path / DB_NAME)
    older = store.create_chat("Plain and greedy", created=1_767_225_600.0)
    store.add_message(older.id, "user", "How do I print?")
    store.add_message(older.id, "assistant", REPLY, meta={"speculative": False})
    store.set_chat_settings(older.id, {"speculative": False, "temperature": 0.0})
    newest = store.create_chat("Creative", created=1_767_229_200.0)
    store.add_message(newest.id, "user", "Write a poem.")
    store.set_chat_settings(newest.id, {"temperature": 1.2, "max_tokens": 64})
    store.close()
    return tmp_path


def settings_file(home):
    return home / "config" / "settings.toml"


def saved(home) -> dict:
    return tomllib.loads(settings_file(home).read_text(encoding="utf-8"))


def run(scenario, size=WIDE, toasts: bool = False) -> None:
    run_offline(scenario, size, toasts=toasts)


# 1. opening a chat (the newest at start, or one from search) rewrote the saved defaults
def test_opening_a_chat_leaves_the_saved_defaults_alone(home):
    async def scenario(app, pilot):
        assert app.chat_screen.conversation.chat_id is not None  # the newest chat opened
        assert (app.settings.temperature, app.settings.max_tokens) == (1.2, 64)  # its own values
        assert (saved(home)["temperature"], saved(home)["max_tokens"]) == (0.7, 256)
        await pilot.press("ctrl+f")
        assert isinstance(app.screen, SearchScreen)
        await pilot.press(*"print", "enter")
        await until(pilot, lambda: app.screen is app.chat_screen, "the hit opened")
        assert not app.settings.speculative and app.settings.temperature == 0.0
        assert saved(home)["speculative"] and saved(home)["temperature"] == 0.7
        await pilot.press("ctrl+t")  # a key changes this chat's own value, kept with it
        chat_id = app.chat_screen.conversation.chat_id
        assert app.store.chat(chat_id).settings["thinking"] == "on"
        assert saved(home)["thinking"] == "auto"
        await pilot.press("f6")  # the settings screen edits the defaults
        assert app.screen.query_one("#num-temperature").value == "0.7"
        await pilot.press("escape")
        await pilot.press("ctrl+n")  # a new chat starts from the defaults
        assert app.settings.speculative and app.settings.temperature == 0.7
        assert app.settings.max_tokens == 256
    run(scenario)


# 2. the user's own prompt was rendered as Markdown: indentation lost, `__init__` bold "init"
def test_the_users_prompt_shows_as_written(home):
    prompt_text = "Why does\n    self.__init__(a*b*c)\nfail?\n\n# not a heading"

    async def scenario(app, pilot):
        await pilot.press("ctrl+n")
        app.chat_screen.query_one(PromptInput).value = prompt_text
        await pilot.press("enter")
        conversation = app.chat_screen.conversation
        await until(pilot, lambda: conversation.generating, "sent")
        await pilot.pause()
        lines = screen_lines(app)
        assert any("    self.__init__(a*b*c)" in line for line in lines)  # indented, literal
        assert any("# not a heading" in line for line in lines)
        assert conversation.request_messages()[-1] == {"role": "user", "content": prompt_text}
    run(scenario)


def notices(app) -> str:
    return "\n".join(str(n.message) for n in app._notifications)


# 3. Ctrl+B found no block in a reply cut inside one, and took only the last of several
def test_copy_code_takes_a_cut_block_and_steps_through_several(home):
    cut = "Start:\n\n```python\nfor i in range(3):\n    print(i"
    whole = "Install:\n```bash\npip install x\n```\nThen:\n~~~python\nimport x\n~~~\n"

    async def scenario(app, pilot):
        await pilot.press("ctrl+n")
        await streamed_reply(app, pilot, [chunk(cut, [1, 2, 3], 2, 1)], "stopped")  # Esc
        await pilot.press("ctrl+b")
        assert app.clipboard == "for i in range(3):\n    print(i"
        await streamed_reply(app, pilot, [chunk(whole, [1, 2, 3], 2, 1)], "done")
        await pilot.press("ctrl+b")  # the last block first, the notice says which
        assert app.clipboard == "import x\n" and "block 2 of 2" in notices(app)
        await pilot.press("ctrl+b")  # again: the one before
        assert app.clipboard == "pip install x\n" and "block 1 of 2" in notices(app)
    run(scenario)


# 4. below 110 columns nothing showed tok/s or τ while a reply streamed
@pytest.mark.parametrize("size", [NARROW, WIDE])
def test_a_streaming_reply_shows_its_speed_at_every_width(home, size):
    async def scenario(app, pilot):
        app.chat_screen.query_one(PromptInput).value = "Count to ten."
        await pilot.press("enter")
        conversation = app.chat_screen.conversation
        await until(pilot, lambda: conversation.generating, "reply started")
        reply_id = conversation.last_view("assistant").message_id
        chunks = [chunk("One", [1], 0, 0), chunk(" two three four", [2, 3, 4, 5], 3, 1),
                  chunk(" five six", [6, 7, 8], 2, 2)]
        conversation.post_message(Conversation.ChunksArrived(reply_id, chunks))

        def status_line() -> str:  # above the footer, whatever the panels show
            return screen_lines(app)[-2]

        await until(pilot, lambda: "tok/s" in status_line(), "the live line", timeout=10)
        tau = app.chat_screen.query_one(SpeedPanel).snapshot.tau
        assert f"τ {tau:.2f}" in status_line() and tau > 1
        assert conversation.generating  # still streaming
    run(scenario, size)


def first_start_log() -> str:
    """A service log as a first start leaves it: progress bars rewritten with CR, a phase line
    rewritten the same way, then the error that ended it."""
    bar = "".join(f"\rimporting: {p:3d}%|{'█' * (p // 10):<10}| {p}/100 [00:0{p // 25}<00:05]"
                  for p in range(0, 101, 4))
    return (f"dflash-local: importing the embedded model once\n{bar}\n"
            "loading model 3 s\rloading model 4 s\rloading model 5 s\n"
            "Traceback (most recent call last):\n  File \"serve.py\", line 9, in main\n"
            "RuntimeError: out of memory while calibrating\n")


# 5. a dead service's toast filled half the screen with the first start's progress bars
def test_a_dead_services_toast_shows_the_logs_last_state_briefly(home):
    log = home / "logs" / "service.log"
    log.parent.mkdir(parents=True)
    log.write_text(first_start_log(), encoding="utf-8")

    async def scenario(app, pilot):
        app.process = ServiceProcess([], log)  # never started: only its log is read
        app.service_ready.set()
        app.post_message(app.ServiceLost("the service exited (exit status 1)"))
        await until(pilot, lambda: bool(app.screen.query("Toast")), "the toast")
        await pilot.pause()
        said = notices(app)
        assert "RuntimeError: out of memory while calibrating" in said
        assert "loading model 5 s" in said and "loading model 4 s" not in said
        assert "%|" not in said  # no progress bar
        toast = app.screen.query_one("Toast")
        assert toast.region.height <= NARROW[1] // 2
    run(scenario, NARROW, toasts=True)


def contrast(foreground, background) -> float:
    """WCAG contrast ratio of two rich colours."""
    def luminance(colour) -> float:
        channels = [c / 255 for c in colour.get_truecolor()]
        linear = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
        return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]
    light, dark = sorted((luminance(foreground), luminance(background)), reverse=True)
    return (light + 0.05) / (dark + 0.05)


def cells(app, text: str) -> list:
    """The rich styles of the cells that show `text` on screen (its first occurrence)."""
    for strip in app.screen._compositor.render_strips():
        line = [(char, segment.style) for segment in strip for char in segment.text]
        plain = "".join(char for char, _ in line)
        if text in plain:
            start = plain.index(text)
            return [style for _, style in line[start:start + len(text)]]
    raise AssertionError(f"{text!r} is not on screen")


# 6. the draft colours were fixed bold green / bold cyan: cyan copies unreadable on the light
#    theme, and in code they replaced the syntax colours
@pytest.mark.parametrize("theme", ["textual-light", "textual-dark"])
def test_draft_colours_keep_the_text_colours_and_read_on_either_theme(home, theme):
    reply = "Like this:\n\n```python\nprint('hi')\n```\n"
    rounds = [[10, 3, 4, 10, 0], [12, 0, 1, 0, 0], [11, 3, 4, 11, 5], [5, 0, 1, 0, 0]]
    store = ChatStore(home / DB_NAME)
    chat = store.create_chat("Painted", created=1_767_232_800.0)  # the newest: it opens
    store.add_message(chat.id, "user", "How do I print?")
    store.add_message(chat.id, "assistant", reply, meta={"speculative": True, "rounds": rounds})
    store.close()
    shown = ("Like this:", "print(", "'hi')")  # prose drafted; code drafted, then copied

    def told_apart(app) -> bool:  # the code is painted: the drafter's tint, then the copy's
        return cells(app, "print(")[0].bgcolor != cells(app, "'hi')")[0].bgcolor

    async def scenario(app, pilot):
        app.theme = theme
        await until(pilot, lambda: told_apart(app), "painted as the chat opens", timeout=10)
        await pilot.press("f3")  # colours off: the text's own colours
        await pilot.pause()
        plain = {text: cells(app, text) for text in shown}
        await pilot.press("f3")
        await until(pilot, lambda: cells(app, "print(")[0] != plain["print("][0], "painted")
        for text in shown:
            painted = cells(app, text)
            assert [s.color for s in painted] == [s.color for s in plain[text]], text
            assert all(s.bgcolor != p.bgcolor for s, p in zip(painted, plain[text])), text
            # AA (4.5:1), or nearly the theme's own where its syntax colours are below that
            readable = min(contrast(s.color, s.bgcolor) for s in plain[text])
            assert min(contrast(s.color, s.bgcolor) for s in painted) >= min(4.5, 0.85 * readable)
        await pilot.press("f10")  # the other theme highlights the code again: still painted
        await pilot.pause()
        assert told_apart(app)
    run(scenario, WIDE)


# 7. the first start: minutes of "loading model N s" (the embedded model's one-off import), then
#    "calibrating" with a counter running from the app's start, none of it explained
def test_first_start_phases_say_what_they_are_that_they_happen_once_and_their_own_time(home):
    async def scenario(app, pilot):
        bar = app.chat_screen.query_one(StatusBar)
        app.post_message(app.ServicePhase("importing embedded"))
        await until(pilot, lambda: app.service_state == "importing embedded", "the import shown")
        assert "importing embedded (first start only)" in str(bar.render())
        assert "converted from the GGUF" in notices(app) and "once" in notices(app)
        bar.busy_since -= 100  # the import took 100 s
        app.post_message(app.ServicePhase("calibrating embedded"))
        await until(pilot, lambda: app.service_state == "calibrating embedded", "calibration")
        counter = re.search(r"calibrating embedded \(once per pair\) (\d+) s", str(bar.render()))
        assert counter is not None and int(counter.group(1)) < 100  # its own time, not the app's
        assert "round costs for embedded" in notices(app) and "once per pair" in notices(app)
    run(scenario)


def test_the_services_phase_lines_reach_the_app(tmp_path):
    """serve's own phase printer, in a child the app starts as it starts serve."""
    script = ("from dflash_local.service.cli_serve import _print_phase as say\n"
              "for phase in ('importing', 'loading', 'calibrating'): say('embedded', phase)\n"
              "print('dflash-local serving embedded on http://127.0.0.1:9', flush=True)\n")
    phases = []
    process = ServiceProcess([], tmp_path / "serve.log", command=(sys.executable, "-c", script),
                             env={"PYTHONPATH": os.pathsep.join(sys.path)}, on_phase=phases.append)

    async def start_and_stop() -> str:
        url = await process.start()
        await process.stop()
        return url

    assert asyncio.run(start_and_stop()) == "http://127.0.0.1:9"
    assert phases == ["importing embedded", "loading embedded", "calibrating embedded"]
