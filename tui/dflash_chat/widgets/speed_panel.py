"""The live speed panel: tokens/s now and as a sparkline, τ, the tokens-per-round histogram,
drafted vs accepted, prefill time, engine and pair. It shows one SpeedSnapshot at a time."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.reactive import reactive
from textual.widgets import Sparkline, Static

from dflash_chat.protocol import MODE_FALLBACK, MODE_LOOKUP, MODE_PROBE
from dflash_chat.stats import SpeedSnapshot
from dflash_chat.widgets import widget_css

BAR_WIDTH = 14
# the prefix cache's tier that served the prompt's start (disk: outlived RAM, or a restart)
TIER_WORDS = {"ram": "from the RAM cache", "disk": "from the disk cache"}


def histogram_text(per_round: tuple[tuple[int, int], ...], width: int = BAR_WIDTH) -> Text:
    """One bar per "k tokens committed in a round"."""
    text = Text()
    most = max((rounds for _, rounds in per_round), default=0)
    for committed, rounds in per_round:
        bar = "█" * max(1, round(width * rounds / most)) if most else ""
        text.append(f"{committed:>3} ")
        text.append(bar, style="green" if committed > 1 else "red")
        text.append(f" {rounds}\n")
    return text


def figures_text(snap: SpeedSnapshot) -> Text:
    text = Text()
    if not snap.live and not snap.final:
        return Text("no reply yet", style="dim")
    if snap.waiting:
        return Text("waiting for the first token", style="yellow")
    now = "       -" if snap.final else f"{snap.tokens_per_s_now:8.1f}"
    text.append(now, style="bold")
    text.append(" tok/s now\n")
    label = "decode" if snap.final else "average"
    text.append(f"{snap.tokens_per_s:8.1f} tok/s {label}\n")
    text.append(f"{snap.tokens:8d} tokens\n")
    if snap.finish_reason == "length":
        text.append("max tokens reached\n", style="bold yellow")
    if snap.ttft_s is not None:
        text.append(f"{snap.ttft_s * 1000:8.0f} ms to first token\n")
    if snap.prefill_s is not None:
        text.append(f"{snap.prefill_s * 1000:8.0f} ms prefill\n")
    if snap.cached_tokens is not None and snap.prompt_tokens:
        text.append(f"{snap.cached_tokens:8d}/{snap.prompt_tokens} prompt tokens cached\n")
        if snap.cached_tokens and snap.cached_tier in TIER_WORDS:
            text.append(f"{'':9}{TIER_WORDS[snap.cached_tier]}\n")
    return text


def compact_speed_text(snap: SpeedSnapshot) -> str:
    """The status bar's one-line figures, at every width: tok/s now (the average once the reply
    has ended) and τ; empty with no reply shown."""
    if not (snap.live or snap.final):
        return ""
    if snap.waiting:
        return "waiting for the first token"
    rate = snap.tokens_per_s if snap.final else snap.tokens_per_s_now
    tau = f" τ {snap.tau:.2f}" if snap.speculative and snap.rounds else " plain"
    return f"{rate:.1f} tok/s{tau}"


def speculation_text(snap: SpeedSnapshot) -> Text:
    text = Text()
    if not (snap.live or snap.final):
        return Text("-", style="dim")
    if snap.waiting:  # no round yet: no block size or tau to show
        return Text(f"{'speculative' if snap.speculative else 'plain'}: no round yet", style="dim")
    if not snap.speculative:
        text.append("plain decoding", style="bold red")
        text.append(f"\n{snap.rounds} rounds, 1 token each\n")
        return text
    text.append("speculative", style="bold green")
    text.append(f"  B={snap.block_size}\n")
    if snap.plain_rounds:  # the auto block policy fell back to plain decoding for these
        style = "bold yellow" if snap.mode in (MODE_FALLBACK, MODE_PROBE) else ""
        text.append(f"plain fallback {snap.plain_rounds}/{snap.rounds} rounds\n", style=style)
    if snap.lookup_rounds:  # rounds that verified a lookup draft (lookup.py) instead of drafting
        style = "bold cyan" if snap.mode == MODE_LOOKUP else ""
        text.append(f"prompt lookup {snap.lookup_rounds}/{snap.rounds} rounds\n", style=style)
    text.append("tau ")
    text.append(f"{snap.tau:.2f}", style="bold")
    text.append(f" per round ({snap.rounds} rounds)\n")
    text.append(f"accepted {snap.accepted}/{snap.reachable} drafted ({snap.acceptance:.0%})\n")
    if snap.drafted > snap.reachable:  # tree drafts: siblings verified beside the kept paths
        text.append(f"{snap.drafted} tree nodes verified\n")
    return text


class SpeedPanel(Vertical):
    DEFAULT_CSS = widget_css(__file__)

    snapshot: reactive[SpeedSnapshot] = reactive(SpeedSnapshot, always_update=True)
    pair: reactive[str] = reactive("")
    adapt: reactive[str] = reactive("")  # adapt_view.adapt_sentence: empty when it does not adapt

    def compose(self) -> ComposeResult:
        yield Static("Speed", classes="title")
        yield Static(id="figures")
        yield Sparkline([], id="sparkline")
        yield Static("Speculation", classes="title")
        yield Static(id="speculation")
        yield Static("Tokens per round", classes="title")
        yield Static(id="histogram")
        yield Static("Engine", classes="title")
        yield Static(id="engine", markup=False)
        yield Static("Drafter", classes="title adapt")
        yield Static(id="adapt", classes="adapt", markup=False)

    def on_mount(self) -> None:
        self.watch_snapshot(self.snapshot)
        self._show_adapt()  # hidden until the service says the drafter adapts

    def watch_snapshot(self, snap: SpeedSnapshot) -> None:
        if not self.is_mounted:
            return
        self.query_one("#figures", Static).update(figures_text(snap))
        self.query_one("#sparkline", Sparkline).data = list(snap.samples)
        self.query_one("#speculation", Static).update(speculation_text(snap))
        self.query_one("#histogram", Static).update(histogram_text(snap.per_round) or "-")
        self._show_engine()

    def watch_pair(self) -> None:
        if self.is_mounted:
            self._show_engine()

    def watch_adapt(self) -> None:
        if self.is_mounted:
            self._show_adapt()

    def _show_adapt(self) -> None:
        self.query_one("#adapt", Static).update(self.adapt)
        self.query(".adapt").set(display=bool(self.adapt))

    def _show_engine(self) -> None:
        lines = (self.snapshot.engine, self.pair, self.snapshot.drafter)
        self.query_one("#engine", Static).update("\n".join(x for x in lines if x) or "-")
