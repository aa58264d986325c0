"""The prefix cache's disk tier: entries that outlive the process, below the RAM LRU.

When a turn ends (or a hybrid's prompt does, mid-stream), the state the RAM tier keeps
(prefix_cache.Kept) is queued, and a background thread packs it to numpy and writes it: a kept
state is never written after it is stored (the RAM tier serves it as it is), so it is read there
off the request's path. A request whose prompt the RAM tier gives fewer rows than the disk does
loads the entry back. The index of entries is read at start and again only when the directory's
mtime says another process (or `cache clear`) changed it. Entries live in one directory per pair (`pair_key`: both models' paths, configs and weight
files, the dtype, the engine, the chat template), so one pair's entry is never served to another.

Eviction is LRU by whole entry, across every pair, under `budget` bytes: an entry is one turn's
state, reused whole or as a prefix, and blocks would buy sharing between conversations at the
cost of an index to keep consistent across processes and crashes; a manifest's mtime is its last
use. Two processes on one data dir write under distinct names and evict under an fcntl lock; a
torn or corrupt entry (prefix_disk_format.py) is deleted and logged, never loaded.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import hashlib
import json
import logging
import os
import queue
import shutil
import threading
import time
import uuid
from pathlib import Path

import numpy as np

from dflash_local.method.prefix_cache import (
    MIB,
    Entry,
    Kept,
    best_hit,
    checked_budget,
    superseded,
)
from dflash_local.method.prefix_disk_format import (
    MANIFEST,
    PAYLOAD,
    TEMPORARY,
    CorruptEntry,
    LeafCodec,
    Unpackable,
    pack,
    read_manifest,
    read_payload,
    unpack,
    write_entry,
)

log = logging.getLogger(__name__)
FORMAT = 1  # bumped when an entry's layout changes: older entries then belong to no pair
# a laptop's default: a few long conversations of an 8B pair (a 30K-token agent prompt is ~4 GB
# of float16 KV there, the embedded pair's ~0.2 GB), and at most a quarter of the free space
DEFAULT_DISK_MB = 2048
ORPHAN_AGE_S = 600  # a payload without its manifest this old is a crashed write, not one under way
PENDING_WRITES = 2  # turns waiting to be written; a later one is skipped (the cache is a hint)
# a directory mtime this recent may yet hide a change made in the same clock tick: read it again
SETTLED_NS = 2_000_000_000
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".npz")
TEXT_FILES = ("config.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json")


def files_signature(path: Path | None) -> dict | None:
    """What identifies a model directory's revision: its config's and chat template's sha256
    (the tokenizer config holds the template) and its weight files' names, sizes and times
    (hashing gigabytes at every load would cost seconds)."""
    if path is None:
        return None
    path = Path(path).resolve()
    weights = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in path.iterdir()
                     if p.suffix in WEIGHT_SUFFIXES)
    texts = {name: hashlib.sha256((path / name).read_bytes()).hexdigest()
             for name in TEXT_FILES if (path / name).exists()}
    return {"path": str(path), "weights": weights, "texts": texts}


def pair_key(identity: dict) -> str:
    """The directory name of a pair's entries: a hash of everything that makes its states."""
    text = json.dumps({**identity, "format": FORMAT}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def disk_budget_bytes(megabytes: int | None, directory: Path) -> int:
    """A `--prefix-cache-disk-mb` value as bytes (None: the default, at most a quarter of the
    room); negative or more than the room is refused; 0 turns the tier off. The room is the
    free space plus what the cache's entries hold already (eviction frees it for new ones)."""
    room = shutil.disk_usage(_existing_parent(directory)).free + cache_bytes(directory)
    if megabytes is None:
        return min(DEFAULT_DISK_MB * MIB, room // 4)
    return checked_budget("--prefix-cache-disk-mb", megabytes, 0, "0 turns the disk tier off",
                          room, f"the free space of {directory} with the cache's own entries")


def cache_bytes(root: Path) -> int:
    """What every pair's entries under `root` hold on disk."""
    return sum(size for _, size in entry_files(root)) if root.is_dir() else 0


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def make_disk_tier(root: Path, identity: dict, budget: int, codec: LeafCodec) -> DiskTier | None:
    """The pair's disk tier under `root`, or None (budget 0, or `root` cannot be written: a
    warning, and the engine serves from RAM only)."""
    if budget <= 0:
        return None
    try:
        return DiskTier(root, identity, budget, codec)
    except OSError as error:
        log.warning("prefix cache: %s cannot be written (%s): the disk tier is off, RAM only",
                    root, error.strerror or error)
        return None


class DiskTier:
    """A pair's entries on disk; `lookup`/`load` on a request's thread, `submit` when a turn
    ends, the writes on a thread of its own."""

    def __init__(self, root: Path, identity: dict, budget: int, codec: LeafCodec):
        self.root, self.budget, self.codec = root, budget, codec
        self.pair = pair_key(identity)
        self.directory = root / self.pair
        self.directory.mkdir(parents=True, exist_ok=True)
        probe = self.directory / f".probe.{os.getpid()}{TEMPORARY}"
        probe.write_bytes(b"")  # a read-only cache dir is found now, not at the first write
        probe.unlink()
        (self.directory / "pair.json").write_text(json.dumps(identity, indent=1, default=str))
        self.note: str | None = None  # why writes stopped (a full disk), said once
        self._index: dict[str, Entry] = {}
        self._seen_mtime: int | None = None  # the directory's, when the index was last read
        self._lock = threading.Lock()
        self._pending: queue.Queue = queue.Queue(maxsize=PENDING_WRITES)
        self._closed = False
        sweep_orphans(root)
        with self._lock:
            self._refresh()  # at start: a request then reads no manifest another run wrote
        atexit.register(self.flush)  # before the interpreter stops the writer: no write is cut
        self._writer = threading.Thread(target=self._write_loop, name="prefix-disk", daemon=True)
        self._writer.start()

    # --- a request's thread ---

    def lookup(self, prompt_ids: list[int], needs_taps: bool) -> tuple[str, int] | None:
        """(entry name, rows) of the entry that gives the prompt the most rows; None: none."""
        with self._lock:
            self._refresh()
            return best_hit(self._index.items(), prompt_ids, needs_taps)

    def load(self, name: str) -> Entry | None:
        """The entry's state, read and checked; None where it vanished (another process
        evicted it) or was corrupt (deleted, logged)."""
        with self._lock:
            indexed = self._index.get(name)
        if indexed is None:
            return None
        try:
            manifest = read_manifest(self.directory / (name + MANIFEST))
            arrays = read_payload(self.directory / (name + PAYLOAD), manifest)
            state = unpack(manifest["skeleton"], arrays, self.codec)
            os.utime(self.directory / (name + MANIFEST))  # its last use, for the LRU
        except FileNotFoundError:
            self._forget(name)
            return None
        except (CorruptEntry, KeyError, ValueError, TypeError) as error:
            log.warning("prefix cache: entry %s dropped: %s", name, error)
            self._delete(name)
            return None
        return Entry(indexed.token_ids, Kept(state, **manifest["kept"]))

    def submit(self, token_ids: list[int], kept: Kept) -> None:
        """Queue a turn's state for the writer (which packs it: nothing is copied here);
        skipped when too large, when writes are behind, after a full disk or `close`."""
        if self._closed or self.note is not None or kept.nbytes > self.budget:
            return
        try:
            self._pending.put_nowait(([int(t) for t in token_ids], kept))
        except queue.Full:
            pass  # the cache is a hint: a turn the writer cannot keep up with is not written

    def flush(self) -> None:
        """Wait until every submitted entry is written (a clean shutdown keeps its last turns)."""
        self._pending.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer (the engine unloads): no thread or exit
        hook outlives the engine. Lookups and loads still work; submits are ignored."""
        if self._closed:
            return
        self._closed = True
        self._pending.put(None)
        self._writer.join()
        atexit.unregister(self.flush)

    def recent(self, count: int, within: int) -> list[str]:
        """Names of this pair's most recently used entries, the latest first: at most `count`,
        their states within `within` bytes (one too large is passed over)."""
        entries = self.entries()
        chosen, room = [], within
        for name in sorted(entries, key=lambda name: _mtime(self.directory / (name + MANIFEST)),
                           reverse=True):
            if len(chosen) == count:
                break
            if entries[name].kept.nbytes <= room:
                chosen.append(name)
                room -= entries[name].kept.nbytes
        return chosen

    def entries(self) -> dict[str, Entry]:
        """This pair's entries by name, as the directory holds them now."""
        with self._lock:
            self._refresh()
            return dict(self._index)

    def status(self) -> dict:
        """The budget, what every pair's entries hold against it, this pair's entry count, and
        why writes stopped (None: they did not)."""
        return {"budget_bytes": self.budget, "bytes": cache_bytes(self.root),
                "entries": len(self.entries()), "note": self.note}

    # --- the writer's thread ---

    def _write_loop(self) -> None:
        while True:
            job = self._pending.get()
            try:
                if job is None:  # `close`
                    return
                self._write(*job)
            except Exception:  # the writer must outlive any entry: `flush` (and exit) waits on it
                log.exception("prefix cache: an entry was not written")
            finally:
                self._pending.task_done()

    def _write(self, token_ids: list[int], kept: Kept) -> None:
        try:
            skeleton, arrays = pack(kept.state, self.codec)
        except Unpackable as error:
            self._stop(f"{error}: this engine's entries stay in RAM")
            return
        manifest = {"pair": self.pair, "token_ids": token_ids,
                    "kept": {"nbytes": kept.nbytes, "whole_only": kept.whole_only,
                             "has_taps": kept.has_taps}, "skeleton": skeleton}
        name = uuid.uuid4().hex
        try:
            write_entry(self.directory, name, arrays, manifest)
        except OSError as error:
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                self._stop("the disk holding the cache is full: entries are no longer written")
            else:
                log.warning("prefix cache: entry not written to %s (%s)", self.directory, error)
            return
        ids = np.asarray(token_ids)
        with self._lock:
            replaced = superseded(self._index.items(), ids, kept)
            self._index[name] = Entry(ids, Kept(None, **manifest["kept"]))
        for other in replaced:  # the new entry serves their prompts as well
            self._delete(other)
        evict(self.root, self.budget)

    def _stop(self, reason: str) -> None:
        if self.note is None:
            log.warning("prefix cache: %s", reason)
        self.note = reason

    # --- the index: this process's view of the directory ---

    def _refresh(self) -> None:
        """Read manifests another process (or an earlier run) wrote and forget vanished ones,
        when the directory changed since the last read (its mtime: a rename or unlink sets it)."""
        try:
            mtime = self.directory.stat().st_mtime_ns
        except FileNotFoundError:
            mtime = None
        if mtime is not None and mtime == self._seen_mtime:
            return
        settled = mtime is not None and time.time_ns() - mtime > SETTLED_NS
        self._seen_mtime = mtime if settled else None
        names = manifest_names(self.directory)
        for name in set(self._index) - names:
            del self._index[name]
        for name in names - set(self._index):
            try:
                manifest = read_manifest(self.directory / (name + MANIFEST))
                if manifest["pair"] != self.pair:
                    raise CorruptEntry(f"its pair {manifest['pair']} is not {self.pair}")
                self._index[name] = Entry(np.asarray(manifest["token_ids"]),
                                          Kept(None, **manifest["kept"]))
            except FileNotFoundError:
                continue
            except (CorruptEntry, KeyError, TypeError) as error:
                log.warning("prefix cache: entry %s dropped: %s", name, error)
                self._remove_files(name)

    def _forget(self, name: str) -> None:
        with self._lock:
            self._index.pop(name, None)

    def _delete(self, name: str) -> None:
        self._forget(name)
        self._remove_files(name)

    def _remove_files(self, name: str) -> None:
        for suffix in (MANIFEST, PAYLOAD):  # the manifest first: no entry without its payload
            (self.directory / (name + suffix)).unlink(missing_ok=True)


def manifest_names(directory: Path) -> set[str]:
    """The names of the entries whose manifest is in `directory` (one pair's)."""
    return {path.name[: -len(MANIFEST)] for path in directory.glob("*" + MANIFEST)
            if path.name != "pair.json"}


def entry_files(root: Path) -> list[tuple[Path, int]]:
    """(manifest, bytes of the entry) of every entry under `root`, least recently used first."""
    found = []
    for manifest in root.glob("*/*" + MANIFEST):
        if manifest.name == "pair.json":
            continue
        try:
            payload = manifest.with_suffix(PAYLOAD).stat().st_size
            stat = manifest.stat()
        except FileNotFoundError:
            continue
        found.append((stat.st_mtime_ns, manifest, stat.st_size + payload))
    return [(manifest, size) for _, manifest, size in sorted(found)]


def evict(root: Path, budget: int) -> int:
    """Delete least recently used entries (every pair's) until all fit in `budget` bytes;
    returns how many went. Under a lock: two processes never evict at once."""
    with open(root / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries = entry_files(root)
        total, dropped = sum(size for _, size in entries), 0
        for manifest, size in entries:
            if total <= budget:
                break
            manifest.unlink(missing_ok=True)
            manifest.with_suffix(PAYLOAD).unlink(missing_ok=True)
            total, dropped = total - size, dropped + 1
    return dropped


def sweep_orphans(root: Path) -> None:
    """Delete what crashed writes left: temporary files of processes no longer running, and
    payloads whose manifest never came (older than ORPHAN_AGE_S: a write may be under way)."""
    now = time.time()
    for path in root.glob("*/*" + TEMPORARY):
        pid = path.name[: -len(TEMPORARY)].rsplit(".", 1)[-1]
        if not pid.isdigit() or not _running(int(pid)) or now - _mtime(path) > ORPHAN_AGE_S:
            path.unlink(missing_ok=True)
    for payload in root.glob("*/*" + PAYLOAD):
        if not payload.with_suffix(MANIFEST).exists() and now - _mtime(payload) > ORPHAN_AGE_S:
            payload.unlink(missing_ok=True)


def clear(root: Path) -> int:
    """Delete every entry under `root` (every pair's); returns how many."""
    return evict(root, -1)  # below any total, empty entries included


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return time.time()
