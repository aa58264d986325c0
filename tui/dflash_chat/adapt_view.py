"""The drafter's adaptation as the app shows it: `/dflash/status`'s `adapt` object read into an
`AdaptState`, and the words for it (the status bar's line, the speed panel's sentence, the
drafter screen's history, the version that served a reply).

Boundary: pure Python, no Textual, no HTTP. A service that does not adapt (an older one, a served
engine, `serve --no-adapt`) gives a disabled state, which shows nothing.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdaptVersion:
    """One adapted drafter that replaced the one serving: τ on recent held-out replies."""

    version: int
    trained_on: int  # recorded replies it was trained on
    tau_before: float  # the drafter it replaced
    tau_after: float
    at: str  # ISO 8601, as the service sends it


@dataclass(frozen=True)
class AdaptState:
    enabled: bool = False
    recording: bool = False
    replies: int = 0  # recorded for this pair
    pending: int = 0  # recorded, not yet trained on
    training: bool = False
    version: int | None = None  # None: the shipped drafter serves
    trained_on: int = 0
    tau_shipped: float | None = None  # τ on the recent chats, shipped drafter
    tau_serving: float | None = None  # ... the one serving now
    tau_candidate: float | None = None  # ... the one in training, at the last round
    history: tuple[AdaptVersion, ...] = ()

    @property
    def catching_up(self) -> bool:
        """Training now, or replies waiting for it: worth asking the service again soon."""
        return self.enabled and (self.training or self.pending > 0)


def adapt_state(status: dict) -> AdaptState:
    """The state from a `/dflash/status` body: its `adapt` object (or, from a service that only
    records, the loaded pair's); missing or malformed fields read as their defaults."""
    raw = status.get("adapt")
    if not isinstance(raw, dict):
        raw = (status.get("loaded") or {}).get("adapt")
    if not isinstance(raw, dict):
        return AdaptState()
    tau = raw.get("tau_recent") if isinstance(raw.get("tau_recent"), dict) else {}
    last_round = raw.get("last_round") if isinstance(raw.get("last_round"), dict) else {}
    return AdaptState(
        enabled=bool(raw.get("enabled", raw.get("recording", False))),
        recording=bool(raw.get("recording", False)),
        replies=_count(raw.get("replies", raw.get("recorded"))),
        pending=_count(raw.get("pending")), training=bool(raw.get("training", False)),
        version=raw["version"] if isinstance(raw.get("version"), int) else None,
        trained_on=_count(raw.get("trained_on")),
        tau_shipped=_tau(tau.get("shipped")), tau_serving=_tau(tau.get("serving")),
        tau_candidate=_tau(last_round.get("tau_candidate")),
        history=tuple(v for v in map(_version, raw.get("history") or ()) if v is not None))


def _count(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _tau(value) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _version(raw) -> AdaptVersion | None:
    if not isinstance(raw, dict) or not isinstance(raw.get("version"), int):
        return None
    before, after = _tau(raw.get("tau_before")), _tau(raw.get("tau_after"))
    if before is None or after is None:
        return None
    return AdaptVersion(raw["version"], _count(raw.get("trained_on")), before, after,
                        str(raw.get("at") or ""))


def _tau_change(state: AdaptState) -> str:
    if state.tau_shipped is None or state.tau_serving is None:
        return ""
    return f"{state.tau_shipped:.1f} -> {state.tau_serving:.1f}"


def _in_training(state: AdaptState) -> str:
    """How the drafter in training compares on the recent chats: why it does not serve yet."""
    if state.tau_candidate is None or state.tau_serving is None:
        return ""
    return f" (in training: tau {state.tau_candidate:.2f} against {state.tau_serving:.2f})"


def adapt_sentence(state: AdaptState) -> str:
    """The speed panel's words: what the drafter has learnt of this user's replies."""
    if not state.enabled:
        return ""
    if state.training:
        return f"learning... ({state.pending} new replies)" if state.pending else "learning..."
    if state.version is None:
        if not state.recording:
            return "recording paused: the shipped drafter serves"
        return f"{state.replies} replies recorded: the shipped drafter serves{_in_training(state)}"
    change = _tau_change(state)
    tail = f": tau on your recent chats {change}" if change else ""
    return f"adapted on {state.trained_on} of your replies{tail}"


def adapt_short(state: AdaptState) -> str:
    """The status bar's few words (empty: nothing adapted, nothing training)."""
    if not state.enabled:
        return ""
    if state.training:
        return "learning..."
    if state.version is None:
        return ""
    change = _tau_change(state)
    return f"adapted {state.trained_on}" + (f" τ {change.replace(' -> ', '→')}" if change else "")


def served_by(dflash: dict) -> str:
    """Which drafter served a reply, from its `dflash` totals (empty: the service did not say)."""
    if "drafter_version" not in dflash:
        return ""
    version = dflash["drafter_version"]
    return f"adapted drafter v{version}" if isinstance(version, int) else "shipped drafter"


def history_lines(state: AdaptState) -> list[str]:
    """The drafter screen's table: one line per version, newest last."""
    lines = [f"{'version':>7}  {'trained on':>10}  {'tau before -> after':>19}  when"]
    for entry in state.history:
        when = entry.at.replace("T", " ")[:16]
        lines.append(f"{'v' + str(entry.version):>7}  {entry.trained_on:>10}  "
                     f"{entry.tau_before:>9.2f} -> {entry.tau_after:<6.2f}  {when}")
    return lines
