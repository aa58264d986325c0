"""What else took the CPU while we measured: the hypervisor's steal time (Linux /proc/stat).

A virtual machine whose host is busy loses CPU time to other guests ("steal"); timings then
swing by tens of percent from one run to the next with nothing else running here. The load
average cannot see it, so the benchmark records the stolen share of each dataset's time.
"""

from __future__ import annotations

from pathlib import Path

PROC_STAT = Path("/proc/stat")
STEAL_COLUMN = 7  # user nice system idle iowait irq softirq steal ...
NOISY_STEAL_SHARE = 0.03  # above this share of CPU time stolen, timings are suspect


def cpu_ticks(path: Path = PROC_STAT) -> tuple[int, int] | None:
    """(steal, total) clock ticks of all CPUs since boot; None where there is no /proc/stat."""
    try:
        fields = path.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) <= STEAL_COLUMN + 1:
        return None
    ticks = [int(value) for value in fields[1:]]
    # guest time is already counted in user/nice: leave it out of the total
    total = sum(ticks[: STEAL_COLUMN + 1])
    return ticks[STEAL_COLUMN], total


def steal_share(start: tuple[int, int] | None, end: tuple[int, int] | None) -> float | None:
    """The share of CPU time stolen between two cpu_ticks() readings."""
    if start is None or end is None or end[1] <= start[1]:
        return None
    return round((end[0] - start[0]) / (end[1] - start[1]), 4)
