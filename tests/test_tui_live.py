"""dflash-chat against the real service: a child `serve` process with a tiny random pair.

One service per module (started by the fixture through the app's own ServiceProcess), plus one
test where the app starts its own. Waits are for conditions (`until`), never sleeps.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest
from dflash_chat.app import DFlashChatApp, Options
from dflash_chat.client import DFlashClient
from dflash_chat.screens.picker import PickerScreen
from dflash_chat.screens.race import RaceScreen
from dflash_chat.service import ServiceProcess
from dflash_chat.settings import Settings
from dflash_chat.widgets.conversation import Conversation
from dflash_chat.widgets.prompt_input import PromptInput
from dflash_chat.widgets.speed_panel import SpeedPanel
from dflash_chat.widgets.status_bar import StatusBar
from service_support import LocalHub, make_pair
from tiny_models import drafter_config_json
from tui_support import until as wait_until

SIZE = (120, 40)
LONG_PROMPT = "Tell me a long story."  # the tiny pair runs past 900 tokens on it
INCOMPATIBLE_PAIR = "qwen3-4b"  # faked in the fixture's hub cache with a mismatched drafter
DOWNLOADABLE_PAIR = "qwen3-8b"  # served by a local hub (the tiny pair under the catalog's names)
HUB_REPOS = ("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16")
HOLD_AFTER = 64 * 1024  # bytes of a weights file the local hub sends before it holds the rest


def fake_hub_cache(root: Path, target: Path) -> Path:
    """A Hugging Face cache holding the catalog pair INCOMPATIBLE_PAIR as configs and empty
    weight files (never read: the config check refuses first), its drafter built for a target
    of another hidden size: loading it must be refused."""
    drafter = drafter_config_json(target)
    drafter["hidden_size"] = 32
    configs = {"Qwen/Qwen3-4B": (target / "config.json").read_text(),
               "z-lab/Qwen3-4B-DFlash-b16": json.dumps(drafter)}
    for repo, config in configs.items():
        folder = root / ("models--" + repo.replace("/", "--"))
        snapshot = folder / "snapshots" / ("0" * 40)
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text(config)
        (snapshot / "model.safetensors").write_bytes(b"")  # config only would be incomplete
        (folder / "refs").mkdir()
        (folder / "refs" / "main").write_text("0" * 40)
    return root


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("tui-pair"))


@pytest.fixture(scope="module")
def local_hub(pair):
    with LocalHub(dict(zip(HUB_REPOS, pair, strict=True))) as hub:
        yield hub


@pytest.fixture(scope="module")
def service_env(pair, local_hub, tmp_path_factory) -> dict[str, str]:
    cache = fake_hub_cache(tmp_path_factory.mktemp("tui-hub"), pair[0])
    return {"HF_HUB_CACHE": str(cache), "HF_ENDPOINT": local_hub.url,
            "OMP_WAIT_POLICY": "PASSIVE",
            "DFLASH_LOCAL_HOME": str(tmp_path_factory.mktemp("tui-service-home"))}


def serve_args(pair) -> tuple[str, ...]:
    return ("--engine", "transformers", "--target", str(pair[0]), "--drafter", str(pair[1]))


@pytest.fixture(scope="module")
def service(pair, service_env, tmp_path_factory):
    """(url, api key) of a child service, stopped after the module."""
    process = ServiceProcess(list(serve_args(pair)), tmp_path_factory.mktemp("log") / "serve.log",
                             env=service_env)
    async def start() -> str:
        url = await process.start()
        client = DFlashClient(url, process.api_key)
        try:
            await process.wait_healthy(client)
        finally:
            await client.aclose()
        return url

    loop = asyncio.new_event_loop()  # the child's pipes belong to it; each test runs its own
    try:
        url = loop.run_until_complete(start())
        yield url, process.api_key
    finally:
        loop.run_until_complete(process.stop())
        loop.close()


def make_app(service, **settings) -> DFlashChatApp:
    url, key = service
    return DFlashChatApp(Options(server=url, api_key=key), settings=Settings(**settings))


async def until(pilot, predicate, timeout: float = 180.0, what: str = "condition") -> None:
    """A live service answers slower than the offline app: a longer default wait."""
    await wait_until(pilot, predicate, what=what, timeout=timeout)


async def send(pilot, app: DFlashChatApp, prompt: str, wait_ready: bool = True) -> Conversation:
    conversation = app.chat_screen.conversation
    if wait_ready:
        await until(pilot, lambda: app.service_ready.is_set(), what="service ready")
    shown = len(conversation.views())
    app.chat_screen.query_one(PromptInput).value = prompt
    await pilot.press("enter")
    await until(pilot, lambda: len(conversation.views()) == shown + 2, what="reply started")
    return conversation


async def reply(pilot, app: DFlashChatApp, prompt: str):
    conversation = await send(pilot, app, prompt)
    await until(pilot, lambda: not conversation.generating, what="reply finished")
    await app.workers.wait_for_complete()
    await pilot.pause()
    return conversation.last_view("assistant")


def test_prompt_gets_a_streamed_reply_and_the_speed_panel(service, home):
    async def scenario():
        app = make_app(service, max_tokens=32)
        async with app.run_test(size=SIZE) as pilot:
            view = await reply(pilot, app, "Write a poem.")
            assert view.text
            stored = app.store.message(view.message_id)
            assert stored.status == "done" and stored.content == view.text
            assert view.reasoning_view is None and "reasoning" not in stored.meta  # none sent
            snapshot = app.chat_screen.query_one(SpeedPanel).snapshot
            assert snapshot.final and snapshot.speculative and snapshot.tokens == 32
            assert snapshot.tau >= 1.0 and snapshot.drafted > 0
            assert "tau" in view.header and "tok/s" in view.header
            assert sum(rounds for _, rounds in snapshot.per_round) == snapshot.rounds
            # the service recorded it for the drafter's adaptation, and the app counts it
            await until(pilot, lambda: app.adapt.replies >= 1, what="reply recorded")
            assert app.adapt.enabled and app.adapt.recording
    asyncio.run(scenario())


def test_speculative_toggle_applies_to_the_next_message(service, home):
    async def scenario():
        app = make_app(service, max_tokens=24)
        async with app.run_test(size=SIZE) as pilot:
            await reply(pilot, app, "Write a poem.")
            assert app.chat_screen.query_one(SpeedPanel).snapshot.speculative
            await pilot.press("f2")
            assert not app.settings.speculative
            assert not app.chat_screen.query_one(StatusBar).speculative
            view = await reply(pilot, app, "Write a poem.")
            snapshot = app.chat_screen.query_one(SpeedPanel).snapshot
            assert not snapshot.speculative and snapshot.block_size == 1
            assert snapshot.drafted == 0 and snapshot.tau == 1.0
            assert "plain" in view.header
            assert app.store.message(view.message_id).meta["speculative"] is False
    asyncio.run(scenario())


def test_escape_keeps_the_partial_reply_and_stops_the_service(service, home):
    async def scenario():
        # plain decoding: 900 rounds of one token each, so the reply is still streaming when the
        # key lands (speculative rounds stream the tiny pair's 900 tokens faster than a loaded
        # machine delivers a key)
        app = make_app(service, max_tokens=900, speculative=False)
        async with app.run_test(size=SIZE) as pilot:
            conversation = await send(pilot, app, LONG_PROMPT)
            view = conversation.last_view("assistant")
            await until(pilot, lambda: len(view.rounds) >= 2, what="some tokens shown")
            await pilot.press("escape")
            await until(pilot, lambda: not conversation.generating, what="reply stopped")
            stored = app.store.message(view.message_id)
            assert stored.status == "stopped"
            assert stored.content == view.text and len(stored.meta["rounds"]) >= 2
            assert len(stored.meta["rounds"]) < 900
            status = {}

            async def idle() -> bool:
                status.update(await app.client.status())
                return not status["worker"]["busy"]

            for _ in range(600):
                if await idle():
                    break
                await pilot.pause(0.05)
            assert not status["worker"]["busy"]
            assert status["worker"]["last"]["outcome"] == "cancelled"
    asyncio.run(scenario())


def test_race_says_identical(service, home):
    async def scenario():
        app = make_app(service, max_tokens=40)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.service_ready.is_set(), what="service ready")
            await pilot.press("f4")
            race = app.screen
            assert isinstance(race, RaceScreen)
            race.query_one("#race-prompt").value = "Write a poem."
            await pilot.press("enter")
            await until(pilot, lambda: race.verdict is not None, what="race verdict")
            assert race.verdict.identical and race.verdict.spec_tokens == 40
            assert "identical" in str(race.query_one("#verdict").render())
    asyncio.run(scenario())


def test_picker_lists_the_catalog_and_explains_a_refusal(service, home):
    async def scenario():
        app = make_app(service)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.service_ready.is_set(), what="service ready")
            await pilot.press("f5")
            picker = app.screen
            assert isinstance(picker, PickerScreen)
            await until(pilot, lambda: bool(picker.pairs), what="catalog listed")
            ids = [pair["id"] for pair in picker.pairs]
            assert ids[0] == "embedded" and INCOMPATIBLE_PAIR in ids
            compatible_looking = picker.pairs[ids.index(INCOMPATIBLE_PAIR)]
            assert compatible_looking["available"] == {"target": True, "drafter": True}
            picker.query_one("#pairs").move_cursor(row=ids.index(INCOMPATIBLE_PAIR))
            await pilot.press("l")
            message = picker.query_one("#message")
            await until(pilot, lambda: "Refused" in str(message.render()), what="refusal")
            text = str(message.render())
            assert "hidden_size 32 != target hidden_size 64" in text
            status = await app.client.status()
            assert status["loaded"]["target"].endswith("target")  # the tiny pair stays loaded
    asyncio.run(scenario())


def test_picker_downloads_with_progress_and_cancels(service, local_hub, home):
    async def scenario():
        app = make_app(service)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.service_ready.is_set(), what="service ready")
            await pilot.press("f5")
            picker = app.screen
            await until(pilot, lambda: bool(picker.pairs), what="catalog listed")
            ids = [pair["id"] for pair in picker.pairs]
            assert picker.pairs[ids.index(DOWNLOADABLE_PAIR)]["available"]["target"] is False
            picker.query_one("#pairs").move_cursor(row=ids.index(DOWNLOADABLE_PAIR))
            progress = picker.query_one("#download-status")
            local_hub.hold_after = HOLD_AFTER
            await pilot.press("d")
            await until(pilot, local_hub.holding.is_set, what="a file half sent")
            await until(pilot, lambda: picker.download_id is not None, what="download followed")
            await pilot.press("c")
            message = picker.query_one("#message")
            await until(pilot, lambda: "Cancelling" in str(message.render()), what="cancel sent")
            local_hub.hold_after = None
            local_hub.release.set()  # the cancel takes effect on the next bytes
            await until(pilot, lambda: "cancelled" in str(progress.render()), what="cancelled")
            await pilot.press("d")
            await until(pilot, lambda: ": done" in str(progress.render()), what="downloaded")
            bar = picker.query_one("#progress")
            assert bar.total and bar.progress == bar.total
            await until(pilot, lambda: picker.pairs[ids.index(DOWNLOADABLE_PAIR)]["available"]
                        == {"target": True, "drafter": True}, what="listed as downloaded")
    asyncio.run(scenario())


def test_history_survives_a_restart(service, home):
    async def first_run() -> tuple[str, str]:
        app = make_app(service, max_tokens=16)
        async with app.run_test(size=SIZE) as pilot:
            view = await reply(pilot, app, "Remember me.")
            return "Remember me.", view.text

    async def second_run() -> tuple[list[tuple[str, str]], str]:
        app = make_app(service)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            views = app.chat_screen.conversation.views()
            await pilot.press("up")
            return [(v.role, v.text) for v in views], app.chat_screen.query_one(PromptInput).value

    prompt, answer = asyncio.run(first_run())
    shown, recalled = asyncio.run(second_run())
    assert shown == [("user", prompt), ("assistant", answer)]
    assert recalled == prompt


def test_app_starts_its_own_service_and_is_usable_before_it_loads(pair, service_env, home):
    # block size auto (the default): the child calibrates the pair before it serves, in a data
    # dir of its own (the module's service has cached it in the shared one), and the app says so
    app = DFlashChatApp(Options(serve_args=serve_args(pair),
                                env={**service_env, "DFLASH_LOCAL_HOME": str(home)}),
                        settings=Settings(max_tokens=16, adapt_recording=False))
    states = []

    async def scenario():
        async with app.run_test(size=SIZE) as pilot:
            app.watch(app, "service_state", lambda state: states.append(state))
            await pilot.pause()
            assert app.service_state == "loading model"  # usable while the model loads
            assert isinstance(app.focused, PromptInput)
            conversation = await send(pilot, app, "Hello before the model loads", wait_ready=False)
            # the child imports torch and loads the pair first: minutes on a busy machine
            await until(pilot, lambda: not conversation.generating, timeout=600, what="reply")
            assert app.service_state == "ready" and conversation.last_view("assistant").text
            assert app.process is not None and app.process.running
            assert "calibrating target" in states
            assert states.index("calibrating target") < states.index("ready")
            # recording off in the settings: the child was started with --no-adapt
            assert "--no-adapt" in app.process.serve_args
            app.refresh_status()
            await app.workers.wait_for_complete()
            await pilot.pause()
            assert app.status.get("loaded") and not app.adapt.enabled
        assert not app.process.running  # the app stops its child on exit
    asyncio.run(scenario())


def test_a_killed_service_is_noticed_and_restarted_by_a_key(pair, service_env, home):
    # the module's service has calibrated the pair in service_env's data dir: no wait for that
    app = DFlashChatApp(Options(serve_args=serve_args(pair), env=service_env),
                        settings=Settings(max_tokens=8))

    async def scenario():
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.service_ready.is_set(), timeout=600, what="ready")
            killed = app.process.pid
            os.kill(killed, signal.SIGKILL)  # as `kill -9` from another terminal
            await until(pilot, lambda: app.service_state == "service stopped", what="noticed")
            said = "\n".join(str(n.message) for n in app._notifications)
            assert "killed by signal 9" in said and "ctrl+] restarts it" in said
            assert str(app.service_log) in said
            assert "serving" in app.service_log.read_text()  # the child's stdout is logged
            await pilot.press("ctrl+right_square_bracket")
            await until(pilot, lambda: app.service_state == "ready", timeout=600, what="restart")
            assert app.process.pid != killed
            view = await reply(pilot, app, "Hello again")
            assert view.text and app.store.message(view.message_id).status == "done"
    asyncio.run(scenario())
