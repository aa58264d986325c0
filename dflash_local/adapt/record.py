"""Recording: each reply a local engine finishes goes into the store (store.py), keyed by its pair.

Boundary: what is kept and when; the worker calls `ReplyRecorder.record` once per job, after the
client has its last chunk. Kept: the prompt's ids and the reply's ids (every token the target
committed, stop strings and call markup included: they are what the drafter should have drafted),
the pair, the time and how the reply was sampled. Not kept: the taps (a verify recomputes them
from the ids, and they are thousands of times larger), cancelled or failed replies (cut short,
often the ones a user rejected), anything from a served engine (its server has the ids), and a
chat request's `store: false` (a benchmark's held-out prompts must never become training data).
A store that cannot be written pauses recording for this load with one log line; replies are
served as before. Nothing here sends anything anywhere.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from typing import TYPE_CHECKING

from dflash_local.adapt.store import RecordedPair, ReplyStore, pair_key
from dflash_local.method.prefix_disk import files_signature

if TYPE_CHECKING:
    from dflash_local.engines.interface import PairInfo
    from dflash_local.service.worker import Job

log = logging.getLogger("dflash_local.adapt")


def recorded_pair(pair: PairInfo, names: tuple[str, str | None]) -> RecordedPair:
    """A local pair's key and identity: both models' files. The engine and dtype are left out:
    greedy replies are the same on every engine, and sampled ones follow the same target."""
    identity = {"target": files_signature(pair.target_path),
                "drafter": files_signature(pair.drafter_path)}
    return RecordedPair(pair_key(identity), names[0], names[1], identity)


def reply_meta(job: Job) -> dict:
    """How the reply was made: what a trainer may filter on (a constrained or sampled reply)."""
    request, params = job.request, job.request.params
    return {"temperature": params.temperature, "top_p": params.top_p,
            "constraint": params.constraint.kind if params.constraint else None,
            "thinking": request.thinking, "tools": bool(request.tools),
            "completion": request.raw_prompt is not None}


class ReplyRecorder:
    """One loaded pair's recording. The store opens on the first reply (on the worker's thread),
    so a load never waits for it."""

    def __init__(self, pair: RecordedPair, open_store=ReplyStore):
        self.pair = pair
        self.recorded = 0  # replies kept since the load
        self.paused: str | None = None  # why recording stopped, once it has
        self._open_store = open_store
        self._store: ReplyStore | None = None
        self._lock = threading.Lock()

    def record(self, job: Job) -> None:
        if (self.paused or not job.request.record or job.outcome != "finished"
                or job.prompt_ids is None or not job.reply_ids):
            return
        try:
            with self._lock:
                if self._store is None:
                    self._store = self._open_store()
                self._store.add(self.pair, job.prompt_ids, job.reply_ids, reply_meta(job))
            self.recorded += 1
        except (OSError, sqlite3.Error) as exc:  # read-only folder, full disk, locked too long
            self.paused = f"{type(exc).__name__}: {exc}"
            log.warning("recording replies for adaptation paused until the next load: the store "
                        "under %s cannot be written (%s); replies are served as before",
                        self._store.path if self._store else "the data dir", self.paused)

    def status(self) -> dict:
        return {"recording": self.paused is None, "recorded": self.recorded, "paused": self.paused,
                "pair": self.pair.key}

    def close(self) -> None:
        with self._lock:
            if self._store is not None:
                self._store.close()
                self._store = None
