"""dflash-chat shows the drafter's adaptation: `/dflash/status`'s `adapt` object read (the
contract, the recording-only shape, junk), its words in the status bar and the speed panel, the
drafter screen's history, the version that served a reply, and the recording setting.
The live service's side is in test_tui_live.py."""

from __future__ import annotations

import pytest
from dflash_chat.adapt_view import (
    AdaptState,
    adapt_sentence,
    adapt_short,
    adapt_state,
    history_lines,
    served_by,
)
from dflash_chat.app import DFlashChatApp
from dflash_chat.protocol import StreamUsage
from dflash_chat.screens.drafter import NOT_ADAPTING, DrafterScreen
from dflash_chat.screens.settings import SettingsScreen
from dflash_chat.settings import Settings, load_settings, save_settings
from dflash_chat.widgets.speed_panel import SpeedPanel
from dflash_chat.widgets.status_bar import StatusBar
from tui_support import chunk, run_offline, screen_lines, streamed_reply, until

HISTORY = [{"version": 1, "trained_on": 100, "tau_before": 1.62, "tau_after": 2.05,
            "at": "2026-12-01T10:00:00Z"},
           {"version": 2, "trained_on": 312, "tau_before": 2.05, "tau_after": 2.41,
            "at": "2026-12-03T18:30:00Z"}]
ADAPTED = {"enabled": True, "recording": True, "replies": 340, "pending": 28, "training": False,
           "version": 2, "trained_on": 312, "tau_recent": {"shipped": 1.6, "serving": 2.4},
           "history": HISTORY}


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_LOCAL_HOME", str(tmp_path))  # the chats and settings.toml
    return tmp_path


def status_with(adapt: dict | None) -> dict:
    loaded = {"pair": "tiny", "served_name": "tiny", "engine": "transformers", "drafter": "z/d"}
    return {"loaded": loaded, **({"adapt": adapt} if adapt is not None else {})}


# --- reading the status and the words ---

def test_the_contract_is_read_and_said():
    state = adapt_state(status_with(ADAPTED))
    assert (state.version, state.trained_on, state.replies, state.pending) == (2, 312, 340, 28)
    assert [v.version for v in state.history] == [1, 2]
    assert adapt_sentence(state) == "adapted on 312 of your replies: tau on your recent chats " \
                                    "1.6 -> 2.4"
    assert adapt_short(state) == "adapted 312 τ 1.6→2.4"
    assert state.catching_up  # replies wait for training: the app asks again
    lines = history_lines(state)
    assert "v2" in lines[2] and "312" in lines[2] and "2.05 -> 2.41" in lines[2]
    assert "2026-12-03 18:30" in lines[2]


def test_training_says_learning_and_disabled_says_nothing():
    training = adapt_state(status_with({**ADAPTED, "training": True}))
    assert adapt_short(training) == "learning..." and adapt_sentence(training).startswith(
        "learning...")
    disabled = adapt_state(status_with({**ADAPTED, "enabled": False}))
    assert adapt_short(disabled) == adapt_sentence(disabled) == "" and not disabled.catching_up
    assert adapt_state(status_with(None)) == AdaptState()


def test_the_shipped_drafter_serving_is_said_in_the_panel_not_the_bar():
    fresh = adapt_state(status_with({**ADAPTED, "version": None, "history": [], "pending": 3,
                                     "trained_on": 0, "tau_recent": {"shipped": None,
                                                                     "serving": None}}))
    assert adapt_short(fresh) == ""
    assert adapt_sentence(fresh) == "340 replies recorded: the shipped drafter serves"
    trying = adapt_state(status_with({**ADAPTED, "version": None, "history": [],
                                      "tau_recent": {"shipped": 1.61, "serving": 1.61},
                                      "last_round": {"round": 3, "tau_candidate": 1.64,
                                                     "tau_serving": 1.61, "verdict": "train on"}}))
    assert adapt_sentence(trying) == ("340 replies recorded: the shipped drafter serves "
                                      "(in training: tau 1.64 against 1.61)")


def test_a_recording_only_service_and_junk_fields():
    # a service that records but does not train yet: loaded.adapt as the recorder says it
    recording = adapt_state({"loaded": {"adapt": {"recording": True, "recorded": 4}}})
    assert recording.enabled and recording.replies == 4 and recording.version is None
    junk = adapt_state(status_with({"enabled": True, "replies": "many", "pending": -3,
                                    "version": "2", "tau_recent": [1],
                                    "history": [{"version": 1}, "x", None]}))
    assert (junk.replies, junk.pending, junk.version, junk.history) == (0, 0, None, ())
    assert adapt_sentence(junk) == "recording paused: the shipped drafter serves"


def test_which_drafter_served_a_reply():
    assert served_by({"drafter_version": 3}) == "adapted drafter v3"
    assert served_by({"drafter_version": None}) == "shipped drafter"
    assert served_by({"tau": 2.0}) == ""  # a service that does not say


# --- on the screen ---

def fetched(app: DFlashChatApp, adapt: dict | None) -> None:
    app.on_dflash_chat_app_status_fetched(DFlashChatApp.StatusFetched(status_with(adapt)))


def test_the_status_bar_and_speed_panel_follow_the_status():
    async def scenario(app, pilot):
        bar, panel = app.chat_screen.query_one(StatusBar), app.chat_screen.query_one(SpeedPanel)
        fetched(app, ADAPTED)
        await pilot.pause()
        assert bar.adapt == "adapted 312 τ 1.6→2.4"
        assert panel.adapt.startswith("adapted on 312 of your replies")
        assert any("adapted 312 τ 1.6→2.4" in line for line in screen_lines(app))
        assert any("adapted on 312 of your" in line for line in screen_lines(app))
        fetched(app, {**ADAPTED, "training": True})
        await pilot.pause()
        assert bar.adapt == "learning..."
        fetched(app, {**ADAPTED, "enabled": False})
        await pilot.pause()
        assert bar.adapt == "" and not panel.query_one("#adapt").display
        assert not any("adapted" in line or "learning" in line for line in screen_lines(app))
    run_offline(scenario, (120, 40))


def test_a_replys_details_name_the_drafter_version():
    async def scenario(app, pilot):
        chunks = [chunk("Hi", [1], 0, 0), chunk(" there.", [2, 3], 1, 1, finish="stop")]
        usage = StreamUsage(5, 3, {"tau": 2.0, "decode_tokens_per_s": 50.0, "rounds": 1,
                                   "engine": "transformers", "drafter_version": 3})
        view = await streamed_reply(app, pilot, chunks, "done", usage)
        assert "drafter v3" in view.header
        assert app.chat_screen.query_one(SpeedPanel).snapshot.drafter == "adapted drafter v3"
        assert any("adapted drafter v3" in line for line in screen_lines(app))
    run_offline(scenario, (120, 40))


def test_the_drafter_screen_shows_tau_over_time_and_follows_the_status():
    async def scenario(app, pilot):
        fetched(app, ADAPTED)
        await pilot.press("alt+a")
        await until(pilot, lambda: isinstance(app.screen, DrafterScreen), "drafter screen")
        await pilot.pause()
        text = "\n".join(screen_lines(app))
        assert "adapted on 312 of your replies" in text and "serving: adapted v2" in text
        assert "2.05 -> 2.41" in text and "28 not yet trained on" in text
        fetched(app, None)  # a service that does not adapt
        await pilot.pause()
        text = "\n".join(screen_lines(app))
        assert NOT_ADAPTING[:40] in text and "2.05 -> 2.41" not in text
        await pilot.press("escape")
        assert app.screen is app.chat_screen
    run_offline(scenario, (80, 24))


def test_the_recording_setting_is_a_serve_flag_saved_with_the_defaults(tmp_path):
    assert Settings().serve_flags() == []
    assert Settings(adapt_recording=False).serve_flags() == ["--no-adapt"]
    save_settings(Settings(adapt_recording=False), tmp_path / "settings.toml")
    assert load_settings(tmp_path / "settings.toml") == (Settings(adapt_recording=False), [])

    async def scenario(app, pilot):
        await pilot.press("f6")
        await until(pilot, lambda: isinstance(app.screen, SettingsScreen), "settings")
        switch = app.screen.query_one("#sw-adapt_recording")
        assert switch.value
        switch.value = False
        await pilot.press("ctrl+s")
        await until(pilot, lambda: app.screen is app.chat_screen, "saved")
        assert not app.defaults.adapt_recording
        assert app.defaults.serve_flags() == ["--no-adapt"]  # what _start_service passes
        said = "\n".join(str(n.message) for n in app._notifications)
        assert "Recording off from the next service start" in said
    run_offline(scenario, (120, 40))
