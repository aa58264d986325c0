"""Warming the prefix cache for a conversation's next turn, while the worker is idle.

A kept generation holds the ids the model generated, but the next request re-tokenizes the
reply (a blank line generated as one token can be written as two), and its common prefix with
the kept entry ends where the spellings part: the rest of the reply is prefilled again on the
user's time. Reusing the generated ids would change what the model sees against a server without
the cache, so instead, once a reply is done and no job waits, the worker prefills the
conversation as the next request will spell it (base.next_turn_ids: the reply closed by its end
of turn) from the longest kept prefix, and keeps it as an entry of its own.

It must never delay a request: it runs WARM_CHUNK_ROWS rows at a time and asks `should_stop`
(a job is queued) before each chunk; cut, it stores nothing. What it stores is what a prefill of
the same ids computes, as any entry (prefix_cache.py), so reuse stays lossless.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager

from dflash_local.events import GenerationParams, widest_block

WARM_CHUNK_ROWS = 32  # rows per forward: a request that arrives waits for at most one chunk
NOTHING = None, None, 0, ()


class OpenGenerations:
    """A local engine's generations open now, counted under the lock a warm-up's chunk holds: a
    chunk in flight ends before one opens, and none starts while one is open (they share the
    model's tap hooks). Not held while a generation runs: generations sharing the worker's
    thread (service/lanes.py) never wait on each other."""

    def __init__(self):
        self.guard = threading.Lock()  # held by a warm-up's chunk
        self.count = 0

    def __enter__(self) -> None:
        with self.guard:
            self.count += 1

    def __exit__(self, *exc_info) -> None:
        with self.guard:
            self.count -= 1


def warm(engine, ids: list[int], params: GenerationParams, should_stop: Callable[[], bool],
         guard: AbstractContextManager) -> bool:
    """Prefill `ids` on a local engine (engines/local.py) from its longest kept prefix, with the
    drafter's context when the finished request drafted (`params`), and store the state; False:
    no cache, nothing new, or stopped (nothing stored). Each step runs inside `guard`, after
    `should_stop` said go on."""
    with guard:
        if should_stop():
            return False
        runner, drafter, done, unseen = _start(engine, ids, params)
    if runner is None:
        return False
    while done < len(ids):
        with guard:
            if should_stop():
                return False
            end = min(done + WARM_CHUNK_ROWS, len(ids))
            _logits, taps = runner.prefill(ids[:end], done)
        if taps is not None:
            unseen.append(taps)
        done = end
    with guard:
        return store_state(engine, ids, runner, drafter, unseen)


def store_state(engine, ids: list[int], runner, drafter, unseen: list) -> bool:
    """Keep a state that holds every row of `ids` (the drafter's context in `unseen` taps) as
    an entry of the engine's prefix cache, and on its disk tier (it survives a restart)."""
    kept = engine.prefix_states.snapshot(runner, drafter,
                                         runner.join_taps(unseen) if unseen else None)
    if isinstance(kept, str) or not engine.prefix_cache.store(ids, kept):
        return False
    if engine.prefix_disk is not None:
        engine.prefix_disk.submit(ids, kept)
    return True


def _start(engine, ids: list[int], params: GenerationParams):
    """(runner, drafter, rows restored, their unseen taps); runner None: nothing to warm."""
    cache, states = engine.prefix_cache, engine.prefix_states
    if cache is None or states is None or len(ids) >= engine.capabilities.max_context:
        return NOTHING
    drafter = (engine.make_drafter(params.draft_window)
               if widest_block(params, engine.pair.drafter_block) > 1 else None)
    if not states.accepts(drafter):
        return NOTHING
    hit = cache.lookup(ids, needs_taps=drafter is not None)
    if hit is not None and hit.entry.token_ids[: len(ids)].tolist() == ids:
        return NOTHING  # an entry holds every one of these rows already
    runner = engine.make_runner(collect_taps=drafter is not None)
    if hit is None:
        return runner, drafter, 0, []
    restored = states.restore(hit.entry.kept, hit.rows, runner, drafter)
    return runner, drafter, hit.rows, [] if restored is None else [restored]
