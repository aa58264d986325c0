"""The prefix cache: what a finished generation leaves for the next request of the conversation.

A chat is many turns over one growing prompt. Each local engine keeps, after a generation, its
target's cache, its drafter's context cache and the taps the drafter has not read (an engine's
`PrefixStates`: how to snapshot, restore, trim and measure them); this module owns the policy:
entries keyed by the token ids of the rows they hold, the longest common prefix with a new
prompt, LRU eviction of whole entries under a byte budget. Numpy only.

An entry is stored only by `Resume.keep`, which the loop calls at a round boundary (the
generation finished or was closed between rounds), never mid-prefill or mid-round. A target with
recurrent state (hybrid) cannot trim: its entry is reusable only whole, up to where it was taken.
Reuse is exact: the restored rows are the rows the same prompt would have computed.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np

from dflash_local.errors import InvalidRequestError

log = logging.getLogger(__name__)
MIB = 1 << 20
DEFAULT_ROWS = 65536  # the default budget holds this many rows of the pair (e.g. 8 chats of 8K)
MACHINE_SHARE = 8  # and at most this fraction (1/8) of the machine's memory
K = TypeVar("K")  # an entry's key in a tier: the RAM tier's counter, the disk tier's file name


@dataclass(frozen=True)
class Kept:
    """An engine's snapshot of one generation's state, ready to store."""

    state: Any  # opaque to this module: the engine's arrays
    nbytes: int
    whole_only: bool = False  # recurrent state: reusable only up to its last row, never trimmed
    has_taps: bool = False  # holds the drafter's context and unseen taps


@dataclass
class Entry:
    token_ids: np.ndarray  # ids of the rows the state holds, in order
    kept: Kept


@dataclass(frozen=True)
class Hit:
    entry: Entry
    rows: int  # the prompt's first `rows` rows come from the entry
    tier: str = "ram"  # which tier served the entry: "ram" or "disk" (prefix_disk.py)


class PrefixStates(Protocol):
    """What an engine supplies: its runner's and drafter's state, out and back in."""

    def accepts(self, drafter: Any) -> bool:
        """Whether this drafter's context can be kept and restored (None: no drafter, yes)."""

    def keeps_prompt(self, runner: Any) -> bool:
        """Whether to keep the state where the prompt ends too (recurrent state: an entry is
        reusable only whole, and a reply the next prompt tokenizes otherwise ends the match)."""

    def snapshot(self, runner: Any, drafter: Any, unseen_taps: Any) -> Kept | str:
        """The state after a generation, or why it cannot be kept (a stated reason)."""

    def restore(self, kept: Kept, rows: int, runner: Any, drafter: Any) -> Any:
        """Put the first `rows` rows of `kept` into a fresh runner and drafter (the entry stays
        as it was); returns the taps of restored rows the drafter has not read (or None)."""


@dataclass
class Resume:
    """How a generation starts and ends (speculative.generate): `cached_rows` of the prompt are
    already in the runner's cache, `unseen_taps` their taps the drafter has not read; `keep`,
    called at a round boundary when the generation ends (and where the prompt ends, with
    `keep_prompt`), gets the ids of the cache's rows and the taps the drafter has not read."""

    cached_rows: int = 0
    unseen_taps: Any = None
    keep: Callable[[list[int], Any], None] | None = None
    keep_prompt: bool = False
    cached_tier: str | None = None  # which tier gave the cached rows: "ram" or "disk"


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading ids two sequences share."""
    length = min(len(a), len(b))
    differs = np.flatnonzero(a[:length] != b[:length])
    return int(differs[0]) if len(differs) else length


def usable_rows(entry: Entry, prompt: np.ndarray, needs_taps: bool) -> int:
    """How many of the prompt's rows `entry` gives: at most all but the last (its logits start
    the generation), an entry kept whole only whole, none without the drafter's context the
    request needs (0: none)."""
    if needs_taps and not entry.kept.has_taps:
        return 0
    rows = min(common_prefix(entry.token_ids, prompt), len(prompt) - 1)
    if entry.kept.whole_only and rows < len(entry.token_ids):
        return 0
    return max(rows, 0)


def extends(kept: Kept, ids: np.ndarray, entry: Entry) -> bool:
    """Whether a new trimmable entry (`kept` of rows `ids`) serves every prompt `entry` serves,
    as well."""
    return (len(entry.token_ids) <= len(ids) and not kept.whole_only
            and not entry.kept.whole_only and (kept.has_taps or not entry.kept.has_taps)
            and common_prefix(entry.token_ids, ids) == len(entry.token_ids))


def best_hit(entries: Iterable[tuple[K, Entry]], prompt_ids: list[int],
             needs_taps: bool) -> tuple[K, int] | None:
    """(key, rows) of the entry that gives the prompt the most rows (the first of equals);
    None: none gives any. Both tiers pick with it."""
    prompt = np.asarray(prompt_ids)
    best: tuple[K, int] | None = None
    for key, entry in entries:
        rows = usable_rows(entry, prompt, needs_taps)
        if rows > 0 and (best is None or rows > best[1]):
            best = (key, rows)
    return best


def superseded(entries: Iterable[tuple[K, Entry]], ids: np.ndarray, kept: Kept) -> list[K]:
    """Keys of the entries a new one (`kept` of rows `ids`) replaces: the same rows (the newer
    state), and those it `extends`. Both tiers drop them when it is stored."""
    return [key for key, entry in entries
            if np.array_equal(entry.token_ids, ids) or extends(kept, ids, entry)]


def checked_budget(flag: str, megabytes: int, minimum: int, below: str, limit: int,
                   limit_text: str) -> int:
    """A budget flag's value as bytes: below `minimum` refused (`below` says what to do
    instead), more than `limit` bytes refused naming `limit_text`."""
    if megabytes < minimum:
        raise InvalidRequestError(f"{flag} must be >= {minimum}, got {megabytes} ({below})")
    if megabytes * MIB > limit:
        raise InvalidRequestError(f"{flag} {megabytes} is more than {limit_text} "
                                  f"({limit // MIB} MiB)")
    return megabytes * MIB


def budget_bytes(megabytes: int, machine_bytes: int) -> int:
    """A `--prefix-cache-mb` value as bytes; 0 or more than the machine has is refused."""
    return checked_budget("--prefix-cache-mb", megabytes, 1,
                          "turn the cache off with --no-prefix-cache", machine_bytes,
                          "this machine's memory")


def default_budget_bytes(row_bytes: int, machine_bytes: int) -> int:
    """DEFAULT_ROWS rows of the pair's cache, at most 1/MACHINE_SHARE of the machine's memory."""
    return min(row_bytes * DEFAULT_ROWS, machine_bytes // MACHINE_SHARE)


def make_prefix_cache(enabled: bool, megabytes: int | None, row_bytes: int) -> PrefixCache | None:
    """The engine's cache: `megabytes` (None: the default for a pair whose rows cost
    `row_bytes`), or None when turned off."""
    if not enabled:
        return None
    machine = machine_memory_bytes()
    if megabytes is None:
        return PrefixCache(default_budget_bytes(row_bytes, machine))
    return PrefixCache(budget_bytes(megabytes, machine))


def machine_memory_bytes() -> int:
    import psutil  # the same probe memory_fit uses; imported here so importing stays cheap

    return int(psutil.virtual_memory().total)


@dataclass
class PrefixCache:
    """Entries of recent conversations, least recently used first, within `budget` bytes."""

    budget: int
    _entries: OrderedDict[int, Entry] = field(default_factory=OrderedDict)
    _next_key: int = 0
    _nbytes: int = 0  # the entries' bytes, kept as they come and go (evicting must not re-sum)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt_ids: list[int], needs_taps: bool) -> Hit | None:
        """The entry that gives the prompt the most rows, and how many (always at least one
        prompt row is left to compute: its logits start the generation); None: no entry shares
        a usable prefix (or none was made with the drafter's context this request needs)."""
        with self._lock:
            best = best_hit(self._entries.items(), prompt_ids, needs_taps)
            if best is None:
                return None
            self._entries.move_to_end(best[0])
            return Hit(self._entries[best[0]], best[1])

    def store(self, token_ids: list[int], kept: Kept) -> bool:
        """Keep a generation's state, evicting least recently used entries to fit; an entry
        this one extends is dropped (a trimmable one gives every prompt at least as many rows,
        unless it lacks the drafter's context the other has).
        False: larger than the whole budget, not kept."""
        if kept.nbytes > self.budget:
            log.info("prefix cache: an entry of %d bytes exceeds the budget of %d: not kept",
                     kept.nbytes, self.budget)
            return False
        ids = np.asarray(token_ids)
        with self._lock:
            for key in superseded(self._entries.items(), ids, kept):
                self._drop(key)
            while self._entries and self._nbytes + kept.nbytes > self.budget:
                self._drop(next(iter(self._entries)))  # the least recently used
            self._entries[self._next_key] = Entry(ids, kept)
            self._nbytes += kept.nbytes
            self._next_key += 1
        return True

    def _drop(self, key: int) -> None:
        self._nbytes -= self._entries.pop(key).kept.nbytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._nbytes = 0
