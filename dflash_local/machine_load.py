"""How busy the machine was while we measured: the CPU other processes took, and the load average.

Stdlib only, for whatever times something (calibration, the benchmark). On Linux the CPU
time every CPU spent busy (/proc/stat) less this process's own CPU time says, per second of
wall time, how many cores others used over exactly the span measured; the 1-minute load
average is kept beside it, but it trails a load that just began by tens of seconds.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

PROC_STAT = Path("/proc/stat")
IDLE_COLUMNS = (3, 4)  # idle, iowait in "cpu user nice system idle iowait irq softirq steal"
BUSY_COLUMNS = 8  # the columns up to steal; guest time is already counted in user and nice


@dataclass(frozen=True)
class LoadSample:
    wall_s: float
    own_cpu_s: float  # this process's CPU time, all its threads
    busy_s: float | None  # every CPU's busy time since boot; None without /proc/stat


def sample() -> LoadSample:
    times = os.times()
    return LoadSample(time.perf_counter(), times.user + times.system, _busy_seconds())


def others_cores(start: LoadSample, end: LoadSample) -> float | None:
    """The cores other processes kept busy on average between two samples (None where the
    system's CPU time cannot be read, or no time passed)."""
    wall = end.wall_s - start.wall_s
    if start.busy_s is None or end.busy_s is None or wall <= 0:
        return None
    others = (end.busy_s - start.busy_s) - (end.own_cpu_s - start.own_cpu_s)
    return max(0.0, others / wall)


def load_average() -> float | None:
    """The 1-minute load average (None where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def _busy_seconds(path: Path = PROC_STAT) -> float | None:
    try:
        fields = path.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) <= BUSY_COLUMNS:
        return None
    ticks = [int(value) for value in fields[1 : BUSY_COLUMNS + 1]]
    busy = sum(t for column, t in enumerate(ticks) if column not in IDLE_COLUMNS)
    return busy / os.sysconf("SC_CLK_TCK")
