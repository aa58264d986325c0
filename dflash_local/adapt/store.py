"""The recorded replies: one SQLite file under the data dir, rows keyed by the pair that wrote them.

Boundary: storage only (open, add, evict, read back, reset). What to record and when is
`record.py`'s; the commands are `cli/adapt.py`'s. Token ids are kept as little-endian uint32
blobs: 4 bytes a token. A file SQLite cannot read is set aside and a fresh one started; a pair's
rows are read back only under the identity they were written with.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sqlite3
import sys
import time
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dflash_local import paths
from dflash_local.errors import StorageError

log = logging.getLogger("dflash_local.adapt")
STORE_DIR = "adapt"
STORE_FILE = "replies.sqlite"
MIB = 1 << 20
# enough for the adaptation's training and held-out sets several times over, and a small share
# of a laptop's disk (a 2K-token exchange is ~8 KiB)
MAX_REPLIES = 10_000
MAX_BYTES = 256 * MIB
BUSY_TIMEOUT_S = 5.0  # another process (`adapt reset`, a second service) holding the write lock
SCHEMA = """
CREATE TABLE IF NOT EXISTS pairs (
    key TEXT PRIMARY KEY, target TEXT NOT NULL, drafter TEXT, identity TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS replies (
    id INTEGER PRIMARY KEY AUTOINCREMENT, pair_key TEXT NOT NULL, created REAL NOT NULL,
    prompt_ids BLOB NOT NULL, reply_ids BLOB NOT NULL, bytes INTEGER NOT NULL, meta TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS replies_by_pair ON replies (pair_key, id);
"""


def store_path() -> Path:
    """Where the store lives (not created here)."""
    return paths.data_dir_path() / STORE_DIR / STORE_FILE


def pair_key(identity: dict) -> str:
    """The rows' key: a hash of both models' files (`prefix_disk.files_signature`)."""
    text = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def pack_ids(ids: list[int] | tuple[int, ...]) -> bytes:
    packed = array("I", ids)  # OverflowError for an id outside uint32: never a vocabulary's
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def unpack_ids(blob: bytes) -> list[int]:
    if len(blob) % 4:
        raise StorageError(f"a recorded id blob of {len(blob)} bytes is not whole uint32s")
    ids = array("I")
    ids.frombytes(blob)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tolist()


@dataclass(frozen=True)
class RecordedPair:
    key: str
    target: str
    drafter: str | None
    identity: dict


@dataclass(frozen=True)
class RecordedReply:
    id: int
    pair_key: str
    created: float  # seconds since the epoch
    prompt_ids: list[int]
    reply_ids: list[int]
    meta: dict


def _is_corrupt(error: sqlite3.DatabaseError) -> bool:
    """Not a database, or a malformed one; OperationalError (locked, read-only, full) is not."""
    return not isinstance(error, sqlite3.OperationalError)


class ReplyStore:
    """The store's file, opened once per process user. Budgets bound it as a whole: past either,
    the oldest rows go first, whichever pair wrote them."""

    def __init__(self, path: Path | None = None, max_replies: int = MAX_REPLIES,
                 max_bytes: int = MAX_BYTES):
        self.path = path or store_path()
        self.max_replies = max_replies
        self.max_bytes = max_bytes
        self.set_aside: Path | None = None  # where a corrupt file was moved, if one was
        # the user's prompts: readable by the user alone (OSError: a read-only or full disk)
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            self.connection = self._open()
        except sqlite3.DatabaseError as exc:
            if not _is_corrupt(exc):
                raise
            self.set_aside = self._set_aside(exc)
            self.connection = self._open()

    def _open(self) -> sqlite3.Connection:
        # the worker thread writes; the load's thread opened it: one user at a time (record.py's lock)
        connection = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, check_same_thread=False,
                                     isolation_level=None)
        try:
            checked = connection.execute("PRAGMA quick_check").fetchone()[0]
            if checked != "ok":
                raise sqlite3.DatabaseError(f"quick_check: {checked}")
            connection.execute("PRAGMA journal_mode=WAL")
            connection.executescript(SCHEMA)
        except sqlite3.Error:
            connection.close()
            raise
        return connection

    def _set_aside(self, error: sqlite3.DatabaseError) -> Path:
        aside = self.path.with_name(f"{self.path.stem}.corrupt-{int(time.time())}{self.path.suffix}")
        self.path.rename(aside)
        for suffix in ("-wal", "-shm"):  # a fresh file must not replay the damaged one's journal
            self.path.with_name(self.path.name + suffix).unlink(missing_ok=True)
        log.warning("the recorded replies in %s could not be read (%s): set aside as %s, a fresh "
                    "store started", self.path, error, aside.name)
        return aside

    def close(self) -> None:
        self.connection.close()

    def add(self, pair: RecordedPair, prompt_ids: list[int], reply_ids: list[int],
            meta: dict) -> None:
        """One reply, in one transaction with the eviction it makes necessary."""
        prompt_blob, reply_blob = pack_ids(prompt_ids), pack_ids(reply_ids)
        size = len(prompt_blob) + len(reply_blob)
        with self._transaction() as db:
            db.execute("INSERT OR IGNORE INTO pairs VALUES (?, ?, ?, ?)",
                       (pair.key, pair.target, pair.drafter, json.dumps(pair.identity, default=str)))
            db.execute("INSERT INTO replies (pair_key, created, prompt_ids, reply_ids, bytes, meta) "
                       "VALUES (?, ?, ?, ?, ?, ?)",
                       (pair.key, time.time(), prompt_blob, reply_blob, size, json.dumps(meta)))
            self._evict(db)

    def _evict(self, db: sqlite3.Connection) -> int:
        count, total = db.execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM replies").fetchone()
        if count <= self.max_replies and total <= self.max_bytes:
            return 0
        oldest = db.execute("SELECT id, bytes FROM replies ORDER BY id").fetchall()
        cut = 0
        while cut < len(oldest) and (count - cut > self.max_replies or total > self.max_bytes):
            total -= oldest[cut][1]
            cut += 1
        db.execute("DELETE FROM replies WHERE id <= ?", (oldest[cut - 1][0],))
        db.execute("DELETE FROM pairs WHERE key NOT IN (SELECT DISTINCT pair_key FROM replies)")
        return cut

    def _transaction(self):
        return _Transaction(self.connection)

    def pairs(self) -> list[RecordedPair]:
        rows = self.connection.execute("SELECT key, target, drafter, identity FROM pairs ORDER BY target")
        return [RecordedPair(key, target, drafter, json.loads(identity))
                for key, target, drafter, identity in rows]

    def summary(self) -> list[dict]:
        """Per pair: replies, prompt and reply tokens, bytes, the newest reply's time."""
        rows = self.connection.execute(
            "SELECT pair_key, COUNT(*), SUM(LENGTH(prompt_ids)) / 4, SUM(LENGTH(reply_ids)) / 4, "
            "SUM(bytes), MAX(created) FROM replies GROUP BY pair_key").fetchall()
        names = {pair.key: pair for pair in self.pairs()}
        return [{"pair": key, "target": names[key].target if key in names else None,
                 "drafter": names[key].drafter if key in names else None, "replies": count,
                 "prompt_tokens": prompt, "reply_tokens": reply, "bytes": size, "newest": newest}
                for key, count, prompt, reply, size, newest in rows]

    def replies(self, identity: dict, newest: int | None = None) -> Iterator[RecordedReply]:
        """The replies of the pair with this identity (only the `newest` ones where given), oldest
        first; a stored identity that differs under the same key (a tampered or foreign row) is
        refused, never mixed in."""
        key = pair_key(identity)
        stored = self.connection.execute("SELECT identity FROM pairs WHERE key = ?", (key,)).fetchone()
        if stored is None:
            return
        expected = json.loads(json.dumps(identity, default=str))
        if json.loads(stored[0]) != expected:
            raise StorageError(f"the store's pair {key} was recorded by other models than these; "
                               f"its replies are not used (dflash-local adapt reset --pair {key})")
        yield from self._rows("WHERE pair_key = ?", (key,), newest)

    def count(self, key: str, after_id: int = 0) -> int:
        """One pair's replies recorded after row `after_id` (0: all of them)."""
        return self.connection.execute("SELECT COUNT(*) FROM replies WHERE pair_key = ? AND id > ?",
                                       (key, after_id)).fetchone()[0]

    def all_replies(self, key: str | None = None) -> Iterator[RecordedReply]:
        """Every pair's replies (or one key's), oldest first: for export."""
        yield from self._rows("WHERE pair_key = ?" if key else "", (key,) if key else ())

    def _rows(self, where: str, values: tuple, newest: int | None = None) -> Iterator[RecordedReply]:
        query = f"SELECT id, pair_key, created, prompt_ids, reply_ids, meta FROM replies {where}"
        if newest is None:
            query += " ORDER BY id"
        else:  # the newest rows, read back oldest first
            query = f"SELECT * FROM ({query} ORDER BY id DESC LIMIT ?) ORDER BY id"
            values = (*values, newest)
        for row_id, key, created, prompt, reply, meta in self.connection.execute(query, values):
            yield RecordedReply(row_id, key, created, unpack_ids(prompt), unpack_ids(reply),
                                json.loads(meta))

    def reset(self, key: str | None = None) -> int:
        """Delete every reply (or one pair's), overwriting their pages; returns how many."""
        self.connection.execute("PRAGMA secure_delete=ON")  # a reset leaves no ids in free pages
        with self._transaction() as db:
            where, values = ("WHERE pair_key = ?", (key,)) if key else ("", ())
            deleted = db.execute(f"DELETE FROM replies {where}", values).rowcount
            db.execute("DELETE FROM pairs WHERE key NOT IN (SELECT DISTINCT pair_key FROM replies)")
        return deleted


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on an error): the writer takes the lock up front, so
    two writers wait on the busy timeout rather than fail mid-transaction."""

    def __init__(self, connection: sqlite3.Connection):
        self.connection = connection

    def __enter__(self) -> sqlite3.Connection:
        self.connection.execute("BEGIN IMMEDIATE")
        return self.connection

    def __exit__(self, kind, error, trace) -> None:
        if kind is None:
            self.connection.execute("COMMIT")
        elif self.connection.in_transaction:  # SQLite may have rolled back already (a full disk)
            self.connection.execute("ROLLBACK")
