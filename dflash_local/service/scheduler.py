"""The worker's scheduler: which generations are in flight, and which jobs wait.

Up to `max_batch` generations are in flight, each a lane (lanes.py) that runs its own loop on
the worker thread and hands its verify in: every tick, each lane runs up to its next verify
(or one chunk of its prompt's prefill), then every lane's verify runs as one batch, through the
runner class's `verify_batch` where it has one. The waiting jobs join the free places between
ticks and before a tick's verifies (lanes.py), in arrival order; a finished or cancelled
generation leaves at once. Each generation's runner, drafter, planner and sampler are its
own, so its output is what it would be alone.
Jobs past the free places wait in a queue of `max_queue`; `submit` refuses (a 429) only when
that queue is full and no place is free. `max_batch_for` chooses max_batch.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import TYPE_CHECKING, Any

from dflash_local.errors import MaxBatchError
from dflash_local.service.api_errors import QueueFullError

if TYPE_CHECKING:
    from dflash_local.engines.interface import Engine
    from dflash_local.service.lanes import Lane

Job = Any  # worker.Job: the worker imports this module, not the other way round

# generations in flight unless --max-batch says: an agent's title request and a sub-agent or
# two beside its main stream; fewer where memory cannot hold them at the full context
DEFAULT_MAX_BATCH = 4
GIB = 1024**3


def max_batch_for(engine: Engine, asked: int | None, memory_bytes: int) -> int:
    """The generations the worker keeps in flight on `engine`: `asked` (None: the default), as
    many as `memory_bytes` holds at the full context. A served engine runs one at a time: its
    streams wait on its server, and its totals (`last_stats`) are the last generation's."""
    if asked is not None and asked < 1:
        raise MaxBatchError(f"--max-batch must be >= 1, got {asked}")
    if not engine.capabilities.tokenizes:
        return 1
    each = engine.generation_bytes()
    holds = max(1, memory_bytes // each) if each else DEFAULT_MAX_BATCH
    if asked is None:
        return min(DEFAULT_MAX_BATCH, holds)
    if asked > holds:
        context = engine.capabilities.max_context
        raise MaxBatchError(
            f"--max-batch {asked}: {asked} generations at the full context of {context} tokens "
            f"need {asked * each / GIB:.1f} GiB of caches ({each / GIB:.2f} GiB each), more than "
            f"this machine's memory of {memory_bytes / GIB:.1f} GiB (it holds {holds})")
    return asked


class RoundRobin:
    """The waiting jobs and the lanes in flight: `submit` runs on the event loop, the rest on
    the worker thread; one lock guards both lists."""

    def __init__(self, max_batch: int, max_queue: int):
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.waiting: deque[Job] = deque()
        self.lanes: list[Lane] = []
        self._stopping = False
        self._wake = threading.Condition()

    def submit(self, job: Job) -> None:
        with self._wake:
            free_places = self.max_batch - len(self.lanes)
            if len(self.waiting) >= self.max_queue + free_places:
                raise QueueFullError(f"the generation queue is full ({len(self.waiting)} requests "
                                     f"waiting, {len(self.lanes)} of {self.max_batch} generations "
                                     f"in flight); retry later")
            self.waiting.append(job)
            self._wake.notify()

    @property
    def busy(self) -> bool:
        return bool(self.lanes or self.waiting)

    def joining(self, block: bool, timeout: float | None = None) -> list[Job] | None:
        """The waiting jobs that fit the free places, oldest first; with `block`, wait until one
        comes, or `timeout` seconds at most (then []). None: stopped, with nothing waiting or in
        flight."""
        with self._wake:
            if block:
                self._wake.wait_for(lambda: self.waiting or self._stopping, timeout)
            if self._stopping and not self.waiting and not self.lanes:
                return None
            free_places = self.max_batch - len(self.lanes)
            return [self.waiting.popleft() for _ in range(min(free_places, len(self.waiting)))]

    def add(self, lane: Lane) -> None:
        with self._wake:
            self.lanes.append(lane)

    def remove(self, lane: Lane) -> None:
        with self._wake:
            self.lanes.remove(lane)

    def take_waiting(self) -> list[Job]:
        """Every waiting job, taken out of the queue (an unload fails them)."""
        with self._wake:
            jobs = list(self.waiting)
            self.waiting.clear()
            return jobs

    def stop(self) -> None:
        """End `joining` once the waiting jobs and the lanes have run out."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
