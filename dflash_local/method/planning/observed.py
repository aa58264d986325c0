"""Correcting a calibration with the rounds a generation times.

The auto planner prices rounds from a calibration made at load; a busy moment then (or now)
can leave it wrong about what a wider round costs next to a plain step. Each round the loop
times (propose to commit) is set against its calibrated price at its context, by kind: plain
steps, and wider rounds. Once both kinds have MIN_ROUNDS rounds among their latest WINDOW and
the wider rounds' median ratio is off the plain steps' by more than TOLERANCE, rounds are
re-priced: a plain step at its own ratio, every wider round at theirs. Otherwise the costs stay
as calibrated: a load that slows every round alike changes no choice. While wider rounds
disagree with their price and too few plain steps were timed to tell a slow machine from a dear
verify, `wants_plain_step` asks for one. The timed ratios (`RoundTimes`) outlive a generation:
the engine keeps one per calibration, so the plain steps that check it are taken once, not at
the start of every reply (each one a round that commits a single token).
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from dflash_local.method.planning.costs import RoundCosts

MIN_ROUNDS = 4  # of each kind before their ratio is trusted: two swing with a busy machine
WINDOW = 16  # the latest rounds of each kind: a load that comes or goes is followed
# a smaller disagreement is noise: on a busy machine round times swing by more than 20%, and
# re-pricing on such swings narrows rounds that paid (docs/records/ab-51ebfe8-main.json)
TOLERANCE = 0.5


class RoundTimes:
    """The latest timed rounds, each as measured seconds / calibrated price: plain steps and
    wider rounds apart. One per calibration, shared by the generations that price from it."""

    def __init__(self):
        self.plain: deque[float] = deque(maxlen=WINDOW)
        self.wider: deque[float] = deque(maxlen=WINDOW)


class ObservedCosts:
    def __init__(self, calibrated: RoundCosts, times: RoundTimes | None = None):
        """`times`: the rounds earlier generations timed against the same calibration (None:
        this generation's alone)."""
        self.calibrated = calibrated
        self.times = times if times is not None else RoundTimes()
        self._plain, self._wider = self.times.plain, self.times.wider

    def observe(self, plain: bool, seconds: float, priced_s: float) -> None:
        """A round (a plain step or not) took `seconds`; its calibrated price was `priced_s`."""
        (self._plain if plain else self._wider).append(seconds / priced_s)

    def scales(self) -> tuple[float, float]:
        """(plain step, wider rounds): how much dearer than calibrated each kind is priced now."""
        plain, wider = _median(self._plain), _median(self._wider)
        if plain is None or wider is None or not _off(wider / plain):
            return 1.0, 1.0
        return plain, wider

    def corrected(self) -> RoundCosts:
        """The calibrated costs, re-priced where the timed rounds disagree with them."""
        return self.calibrated.scaled(*self.scales())

    def compared(self) -> bool:
        """Whether enough rounds of both kinds were timed to check the calibration."""
        return len(self._plain) >= MIN_ROUNDS and len(self._wider) >= MIN_ROUNDS

    def wants_plain_step(self) -> bool:
        wider = _median(self._wider)
        return len(self._plain) < MIN_ROUNDS and wider is not None and _off(wider)


def _median(ratios: deque[float]) -> float | None:
    return statistics.median(ratios) if len(ratios) >= MIN_ROUNDS else None


def _off(ratio: float) -> bool:
    return abs(math.log(ratio)) > math.log1p(TOLERANCE)
