"""The service's memory under many clients, for bench --concurrency: this process's resident set
idle, its peak while clients stream (sampled on a thread of its own), and after the batch
drains; beside each, what the engine's prefix cache holds (its budget allows it) and what glibc
keeps of the freed heap (the drained figure again after `malloc_trim`).

Boundary: reads the process and the loaded pair; changes nothing but the C heap's free lists.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Self

import psutil

from dflash_local.service.heap import trim_heap

MIB = 1024**2
SAMPLE_S = 0.05  # the peak's sampling period: a round is longer
QUIET_S = 1.0  # drained: idle this long without a warm-up ending (one takes less)


class Watch:
    """`with watch:` samples the peak while a level's clients stream; `after_drain()` once the
    last of them ended; `figures()` the record's "memory"."""

    def __init__(self, loaded):
        self.loaded = loaded
        self._process = psutil.Process()
        self.idle = self._sample()
        self.peak = dict(self.idle)
        self.drained: dict = {}
        self.trimmed: dict = {}
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None

    def __enter__(self) -> Self:
        self._stop.clear()
        self._sampler = threading.Thread(target=self._watch, name="memory-watch", daemon=True)
        self._sampler.start()
        return self

    def __exit__(self, *exc_info) -> bool:
        self._stop.set()
        self._sampler.join()
        return False

    def after_drain(self, timeout_s: float = 60.0) -> None:
        """The drained figures, once the worker has nothing in flight or waiting and has warmed
        the finished conversations' next turns; then again with the freed heap given back."""
        worker, deadline = self.loaded.worker, time.monotonic() + timeout_s
        warmed = -1  # the warm-ups ended, until a second passes idle without one more
        while (worker.busy or worker.warm_ups_ended != warmed) and time.monotonic() < deadline:
            warmed = worker.warm_ups_ended
            time.sleep(QUIET_S)
        gc.collect()
        self.drained = self._sample()
        trim_heap()
        self.trimmed = self._sample()

    def figures(self) -> dict:
        def mib(sample: dict) -> dict:
            return {key: round(value / MIB, 1) for key, value in sample.items()}

        figures = {"idle_mib": mib(self.idle), "peak_mib": mib(self.peak),
                   "drained_mib": mib(self.drained), "drained_trimmed_mib": mib(self.trimmed)}
        if self.drained:
            figures["words"] = (
                f"resident {figures['idle_mib']['rss']:.0f} MiB idle, "
                f"{figures['peak_mib']['rss']:.0f} MiB at the peak, "
                f"{figures['drained_mib']['rss']:.0f} MiB after the batch drained "
                f"({figures['drained_trimmed_mib']['rss']:.0f} MiB with glibc's free heap given "
                f"back); the prefix cache held {figures['idle_mib']['prefix_cache']:.0f} MiB idle "
                f"and {figures['drained_mib']['prefix_cache']:.0f} MiB after")
        return figures

    def _sample(self) -> dict:
        cache = self.loaded.engine.prefix_cache
        return {"rss": self._process.memory_info().rss,
                "prefix_cache": cache.nbytes if cache is not None else 0}

    def _watch(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            sample = self._sample()
            if sample["rss"] > self.peak["rss"]:
                self.peak = sample
