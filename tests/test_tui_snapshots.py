"""Snapshots of dflash-chat's main screens with fixed content: storage pre-filled, no service
(the race and the picker get their data as the service's messages would bring it).

Update after a deliberate change: pytest tests/test_tui_snapshots.py --snapshot-update
"""

from __future__ import annotations

import time

import pytest
from dflash_chat.app import DFlashChatApp, Options
from dflash_chat.protocol import StreamChunk, StreamUsage
from dflash_chat.screens.picker import PickerScreen
from dflash_chat.screens.race import RaceScreen
from dflash_chat.settings import Settings
from dflash_chat.stats import SpeedSnapshot
from dflash_chat.storage import DB_NAME, ChatStore
from dflash_chat.widgets.prompt_input import PromptInput
from dflash_chat.widgets.speed_panel import SpeedPanel

SIZE = (120, 40)
NARROW = (80, 24)  # below the width where the side panels step aside
CREATED = 1_767_225_600.0  # 2026-01-01 00:00 UTC: the chat list shows each chat's date
REPLY = ("Here is a function that adds two numbers:\n\n```python\ndef add(a, b):\n"
         "    return a + b\n```\n\nCall it as `add(1, 2)`.")
ROUNDS = [[12, 5, 6], [14, 0, 1], [22, 7, 8], [30, 3, 4], [10, 1, 2], [len(REPLY) - 88, 2, 3]]
STATS = {"tau": 4.0, "decode_tokens_per_s": 87.5, "speculative": True, "block_size": 8,
         "engine": "transformers", "prefill_s": 0.031, "drafted": 42, "accepted": 18,
         "rounds": 6, "accepted_per_round": [0, 1, 1, 1, 1, 0, 1, 0, 1]}


@pytest.fixture
def app(tmp_path, monkeypatch) -> DFlashChatApp:
    monkeypatch.setenv("DFLASH_LOCAL_HOME", str(tmp_path))
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    store = ChatStore(tmp_path / DB_NAME)
    store.create_chat("Older chat", created=CREATED)
    chat = store.create_chat("Adding numbers", "Be brief.", created=CREATED + 3600)
    store.add_message(chat.id, "user", "Write a Python function that adds two numbers.")
    store.add_message(chat.id, "assistant", REPLY, "done",
                      {"speculative": True, "rounds": ROUNDS, "stats": STATS})
    store.close()
    return DFlashChatApp(Options(connect=False), settings=Settings(show_accepted=False))


async def steady(pilot) -> None:
    for prompt in pilot.app.screen.query(PromptInput):
        prompt.cursor_blink = False
    await pilot.pause()


async def with_speed(pilot) -> None:
    panel = pilot.app.chat_screen.query_one(SpeedPanel)
    panel.snapshot = SpeedSnapshot(
        speculative=True, tokens=24, tokens_per_s_now=91.0, tokens_per_s=87.5,
        samples=(40.0, 80.0, 95.0, 90.0, 88.0, 91.0), tau=4.0, rounds=6, drafted=42, reachable=42, accepted=18,
        per_round=((1, 1), (2, 1), (3, 1), (4, 1), (6, 1), (8, 1)), prefill_s=0.031,
        block_size=8, engine="transformers", final=True)
    panel.pair = "tiny (transformers, drafter)"
    await steady(pilot)


def test_chat_screen(app, snap_compare):
    assert snap_compare(app, terminal_size=SIZE, run_before=with_speed)


def test_chat_screen_colours_the_drafters_tokens(app, snap_compare):
    app.set_reactive(DFlashChatApp.settings, Settings(show_accepted=True))
    assert snap_compare(app, terminal_size=SIZE, run_before=with_speed)


def test_chat_screen_at_80x24(app, snap_compare):
    assert snap_compare(app, terminal_size=NARROW, run_before=with_speed)


async def settings_open(pilot) -> None:
    await pilot.press("f6")
    pilot.app.focused.cursor_blink = False
    await pilot.pause()


def test_settings_at_80x24(app, snap_compare):
    assert snap_compare(app, terminal_size=NARROW, run_before=settings_open)


def test_help_screen(app, snap_compare):
    assert snap_compare(app, press=["f1"], terminal_size=SIZE, run_before=steady)


def race_chunks(speculative: bool) -> list[StreamChunk]:
    ids = list(range(10, 34))
    if not speculative:
        return [StreamChunk(f"w{i} ", (i,), round=r, block_size=1) for r, i in enumerate(ids)]
    step, chunks, r = 4, [StreamChunk("w10 ", (10,), round=0, block_size=8)], 1
    for start in range(1, len(ids), step):
        block = ids[start:start + step]
        chunks.append(StreamChunk("".join(f"w{i} " for i in block), tuple(block), drafted=7,
                                  accepted=len(block) - 1, round=r, block_size=8))
        r += 1
    return chunks


async def finished_race(pilot) -> None:
    app = pilot.app
    race = RaceScreen(prompt="Count to twenty-four.")
    await app.push_screen(race)
    usage = {False: {"decode_tokens_per_s": 40.0, "tau": 1.0, "speculative": False},
             True: {"decode_tokens_per_s": 100.0, "tau": 4.0, "speculative": True,
                    "drafted": 42, "accepted": 18, "rounds": 6}}
    for lane, speculative in (("plain", False), ("speculative", True)):
        race.post_message(RaceScreen.LaneStarted(lane))
        race.post_message(RaceScreen.LaneChunks(lane, race_chunks(speculative)))
        race.post_message(RaceScreen.LaneEnded(lane, StreamUsage(9, 24, usage[speculative]), None))
    for _ in range(5):
        await pilot.pause()
    race.query_one("#race-prompt").cursor_blink = False
    await pilot.pause()


def test_race_verdict(app, snap_compare):
    assert snap_compare(app, terminal_size=SIZE, run_before=finished_race)


def test_race_verdict_at_80x24(app, snap_compare):
    assert snap_compare(app, terminal_size=NARROW, run_before=finished_race)


async def listed_catalog(pilot) -> None:
    from dflash_local.engines.selection import PlatformInfo
    from dflash_local.pairs.catalog import load_catalog
    from dflash_local.pairs.memory_budget import MachineMemory, budget_for
    from dflash_local.pairs.pair_fit import pair_fits

    # a 32 GB Mac with a 22 GB Metal working set, from the catalog's numbers (nothing local)
    mac = PlatformInfo("Darwin", "arm64", cuda=False, installed=frozenset({"mlx", "torch"}))
    memory = MachineMemory(32 * 2**30, 22 * 2**30, metal=True)
    budgets = {engine: budget_for(engine, mac, memory)
               for engine in ("mlx", "transformers", "vllm", "sglang")}
    pairs = [{**pair.to_json(), "available": {"target": index == 0, "drafter": index == 0},
              "loaded": index == 0, "fit": pair_fits(pair, budgets, 8192)}
             for index, pair in enumerate(load_catalog().pairs)]
    picker = PickerScreen()
    await pilot.app.push_screen(picker)
    picker.post_message(PickerScreen.Listed(pairs, {"available_bytes": 12e9, "total_bytes": 16e9}))
    picker.post_message(PickerScreen.Outcome(
        "load", "qwen3-4b", "drafter does not fit target: drafter hidden_size 32 != target "
        "hidden_size 64"))
    for _ in range(4):  # the table sizes its columns when idle
        await pilot.pause(0.05)


def test_model_picker(app, snap_compare):
    assert snap_compare(app, terminal_size=SIZE, run_before=listed_catalog)


def test_model_picker_at_80x24(app, snap_compare):
    assert snap_compare(app, terminal_size=NARROW, run_before=listed_catalog)


ADAPTED = {"enabled": True, "recording": True, "replies": 340, "pending": 0, "training": False,
           "version": 2, "trained_on": 312, "tau_recent": {"shipped": 1.6, "serving": 2.4},
           "history": [{"version": 1, "trained_on": 100, "tau_before": 1.62, "tau_after": 2.05,
                        "at": "2026-12-01T10:00:00Z"},
                       {"version": 2, "trained_on": 312, "tau_before": 2.05, "tau_after": 2.41,
                        "at": "2026-12-03T18:30:00Z"}]}


async def adapted(pilot) -> None:
    app = pilot.app
    app.on_dflash_chat_app_status_fetched(DFlashChatApp.StatusFetched(
        {"loaded": {"pair": "tiny", "served_name": "tiny", "engine": "transformers",
                    "drafter": "z/d"}, "adapt": ADAPTED}))
    await with_speed(pilot)


def test_chat_screen_says_what_the_drafter_learnt(app, snap_compare):
    assert snap_compare(app, terminal_size=SIZE, run_before=adapted)


async def drafter_open(pilot) -> None:
    await adapted(pilot)
    await pilot.press("alt+a")
    await pilot.pause()


def test_drafter_screen_at_80x24(app, snap_compare):
    assert snap_compare(app, terminal_size=NARROW, run_before=drafter_open)
