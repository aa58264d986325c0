"""Whether a calibration's timings can be trusted: how noisy they were, and how busy the machine.

Two signs, either enough to call a calibration noisy: the repeats of one round disagree (the
spread: each width's upper quartile over its lower quartile, the median over the widths), or
other processes kept more than BUSY_SHARE of the cores busy while it measured
(machine_load.py). calibration.py measures the costs once more when the first try is noisy and
keeps the quieter try; one still noisy is kept marked unreliable (in its cache file, the
service's status, the CLI's phase line), and the auto planner corrects it from the rounds it
times (planning/observed.py).
"""

from __future__ import annotations

import os
import statistics
from dataclasses import asdict, dataclass

from dflash_local import machine_load

SPREAD_LIMIT = 0.3  # a width's slower repeats 30% over its faster ones: something else ran
BUSY_SHARE = 0.25  # of the cores, kept busy by other processes while the calibration measured


def lower_quartile(values: list[float]) -> float:
    """What repeats of one timing are summed up by: other work only ever adds time."""
    return statistics.quantiles(values, n=4, method="inclusive")[0] if len(values) > 1 else values[0]


@dataclass(frozen=True)
class Noise:
    spread: float  # median over widths of (upper quartile / lower quartile - 1)
    others_cores: float | None  # cores other processes kept busy on average (None: unknown)
    load_average: float | None  # the 1-minute load average at the end
    cores: int

    @property
    def reasons(self) -> list[str]:
        """Why the timings are suspect, in words; empty when they are not."""
        found = []
        if self.spread > SPREAD_LIMIT:
            found.append(f"repeats of a round differ by {100 * self.spread:.0f}% "
                         f"(limit {100 * SPREAD_LIMIT:.0f}%)")
        if self.others_cores is not None and self.others_cores > BUSY_SHARE * self.cores:
            found.append(f"other processes kept {self.others_cores:.1f} of {self.cores} cores busy")
        return found

    @property
    def reliable(self) -> bool:
        return not self.reasons

    def to_json(self) -> dict:
        return {**{k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()},
                "reliable": self.reliable, "reasons": self.reasons}

    @classmethod
    def from_json(cls, raw: dict) -> Noise:
        return cls(raw["spread"], raw["others_cores"], raw["load_average"], raw["cores"])


def spread(samples: dict[int, list[float]]) -> float:
    """The median over widths of how far each width's upper quartile is above its lower one."""
    ratios = []
    for seconds in samples.values():
        if len(seconds) > 1:
            low, _, high = statistics.quantiles(seconds, n=4, method="inclusive")
            ratios.append(high / low - 1.0 if low > 0 else 0.0)
    return statistics.median(ratios) if ratios else 0.0


def assess(samples: dict[int, list[float]], started: machine_load.LoadSample) -> Noise:
    """The noise of timings `samples` (seconds per width) taken since `started`."""
    return Noise(spread(samples), machine_load.others_cores(started, machine_load.sample()),
                 machine_load.load_average(), os.cpu_count() or 1)


def warning_line(status: dict | None) -> str | None:
    """What a command prints for an engine's calibration_status(): None when it is reliable."""
    if status is None or status["reliable"] or not status["noise"]:
        return None
    return (f"warning: the calibration was measured while the machine was busy "
            f"({'; '.join(status['noise']['reasons'])}): kept marked unreliable, auto corrects it "
            f"from the rounds it times; --recalibrate on a quieter machine measures it again")
