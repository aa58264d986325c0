"""The race: one prompt through plain decoding, then speculative decoding, on the same engine,
both shown live side by side; then the verdict: speedup, τ, and whether the two outputs are
identical token for token (greedy decoding, so they must be)."""

from __future__ import annotations

from typing import ClassVar

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Input, Static

from dflash_chat.protocol import ServiceError, StreamChunk, StreamUsage
from dflash_chat.stats import LiveStats, RaceVerdict, race_verdict
from dflash_chat.widgets.race_lane import RaceLane

DEFAULT_PROMPT = "Write a short story about a lighthouse keeper."
LANES = (("plain", False), ("speculative", True))
POST_EVERY_S = 1 / 30


class RaceScreen(Screen):
    CSS_PATH = "race.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "leave", "Back (stops the race)")]

    class LaneChunks(Message):
        def __init__(self, lane: str, chunks: list[StreamChunk]):
            super().__init__()
            self.lane = lane
            self.chunks = chunks

    class LaneStarted(Message):
        def __init__(self, lane: str):
            super().__init__()
            self.lane = lane

    class LaneEnded(Message):
        def __init__(self, lane: str, usage: StreamUsage | None, error: str | None):
            super().__init__()
            self.lane = lane
            self.usage = usage
            self.error = error

    class Finished(Message):
        def __init__(self, verdict: RaceVerdict | None):
            super().__init__()
            self.verdict = verdict

    def __init__(self, prompt: str | None = None):
        super().__init__()
        self.prompt = prompt
        self.stats: dict[str, LiveStats] = {}
        self.usage: dict[str, dict] = {}
        self.verdict: RaceVerdict | None = None

    def compose(self) -> ComposeResult:
        last = self.app.store.prompt_history(limit=1)
        yield Input(self.prompt or (last[-1] if last else DEFAULT_PROMPT), id="race-prompt")
        with Horizontal(id="lanes"):
            for name, _ in LANES:
                yield RaceLane(f"{name} decoding", id=f"lane-{name}")
        yield Static("Enter runs the race: plain first, then speculative, same engine, greedy.",
                     id="verdict")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(Input).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        if event.value.strip():
            waiting = "" if self.app.service_ready.is_set() else " (waiting for the service)"
            self.query_one("#verdict", Static).update(f"Racing...{waiting}")
            self.run_race(event.value.strip())

    def action_leave(self) -> None:
        self.workers.cancel_group(self, "race")
        self.dismiss()

    # --- the race: a worker streams both runs; the handlers own what is shown ---

    @work(exclusive=True, group="race")
    async def run_race(self, prompt: str) -> None:
        app = self.app
        await app.service_ready.wait()
        settings = app.settings
        messages = [{"role": "user", "content": prompt}]
        options = {"temperature": 0.0, "max_tokens": settings.max_tokens, **(
            {"block_size": settings.block_size} if settings.block_size else {})}
        for lane, speculative in LANES:
            self.post_message(self.LaneStarted(lane))
            usage, error, pending, posted_at = None, None, [], 0.0
            try:
                async for item in app.client.stream_chat(messages, speculative=speculative,
                                                         **options):
                    if isinstance(item, StreamUsage):
                        usage = item
                        continue
                    pending.append(item)
                    if item.received_at - posted_at >= POST_EVERY_S:
                        self.post_message(self.LaneChunks(lane, pending))
                        pending, posted_at = [], item.received_at
            except ServiceError as exc:
                error = exc.message
            except Exception as exc:  # noqa: BLE001 - the worker's edge: the verdict shows it
                error = f"{type(exc).__name__}: {exc}"
            finally:
                if pending:
                    self.post_message(self.LaneChunks(lane, pending))
                self.post_message(self.LaneEnded(lane, usage, error))
            if error:
                return

    async def on_race_screen_lane_started(self, message: LaneStarted) -> None:
        if message.lane == LANES[0][0]:
            self.stats.clear()
            self.usage.clear()
            self.verdict = None
            for lane_widget in self.query(RaceLane):
                await lane_widget.reset()
        speculative = dict(LANES)[message.lane]
        self.stats[message.lane] = LiveStats(speculative)

    async def on_race_screen_lane_chunks(self, message: LaneChunks) -> None:
        stats = self.stats[message.lane]
        for chunk in message.chunks:
            stats.add(chunk)
        lane = self.query_one(f"#lane-{message.lane}", RaceLane)
        await lane.append("".join(chunk.text for chunk in message.chunks),
                          "".join(chunk.reasoning for chunk in message.chunks))
        lane.snapshot = stats.snapshot()

    async def on_race_screen_lane_ended(self, message: LaneEnded) -> None:
        stats = self.stats[message.lane]
        lane = self.query_one(f"#lane-{message.lane}", RaceLane)
        await lane.finish()
        verdict = self.query_one("#verdict", Static)
        if message.error or message.usage is None:
            verdict.update(f"The {message.lane} run failed: {message.error or 'stopped'}")
            self.post_message(self.Finished(None))
            return
        stats.finish(message.usage.dflash)
        self.usage[message.lane] = message.usage.dflash
        lane.snapshot = stats.snapshot()
        if len(self.usage) == len(LANES):
            plain, spec = (name for name, _ in LANES)
            loaded = self.app.status.get("loaded") or {}
            self.verdict = race_verdict(self.stats[plain].token_ids, self.stats[spec].token_ids,
                                        self.usage[plain], self.usage[spec], loaded.get("dtype"))
            verdict.update(self.verdict.summary())
            verdict.set_class(not self.verdict.identical, "-different")
            self.post_message(self.Finished(self.verdict))
