"""Chat history in SQLite (stdlib sqlite3): chats and their messages.

Boundary: no Textual. Every write is one transaction, in WAL mode, so a killed app loses nothing
already written; a reply being streamed is written as it grows (status "streaming") and a
reply left "streaming" by a crash is marked "interrupted" the next time the store opens.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS chats (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    system_prompt TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
    role TEXT NOT NULL CHECK (role IN ('user', 'assistant')),
    content TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'done',
    meta TEXT NOT NULL DEFAULT '{}',
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_chat ON messages(chat_id, id);
"""
# a reply's reasoning, which its meta keeps, as a column the search can index (added by
# _migrate to every store, new or older)
REASONING_COLUMN = ("reasoning TEXT GENERATED ALWAYS AS (json_extract(meta, '$.reasoning')) "
                    "VIRTUAL")
# search over past chats: an external-content FTS5 index of the messages' content and
# reasoning, kept by triggers
SEARCH_SCHEMA = """
CREATE VIRTUAL TABLE messages_fts USING fts5(content, reasoning, content='messages',
                                             content_rowid='id');
CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN
    INSERT INTO messages_fts(rowid, content, reasoning) VALUES (new.id, new.content, new.reasoning);
END;
CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN
    INSERT INTO messages_fts(messages_fts, rowid, content, reasoning)
        VALUES ('delete', old.id, old.content, old.reasoning);
END;
CREATE TRIGGER messages_fts_update AFTER UPDATE OF content, meta ON messages BEGIN
    INSERT INTO messages_fts(messages_fts, rowid, content, reasoning)
        VALUES ('delete', old.id, old.content, old.reasoning);
    INSERT INTO messages_fts(rowid, content, reasoning) VALUES (new.id, new.content, new.reasoning);
END;
INSERT INTO messages_fts(messages_fts) VALUES ('rebuild');
"""
# an index an older app built (content alone): dropped, then built again with the reasoning
OLD_SEARCH_DROP = """
DROP TRIGGER IF EXISTS messages_fts_insert;
DROP TRIGGER IF EXISTS messages_fts_delete;
DROP TRIGGER IF EXISTS messages_fts_update;
DROP TABLE messages_fts;
"""
MATCH_OPEN, MATCH_CLOSE = "\x02", "\x03"  # snippet marks, shown as [ ]: no text holds them
SEARCH_LIMIT = 50
STATUSES = ("done", "streaming", "stopped", "interrupted", "error")
DB_NAME = "chats.sqlite3"
BUSY_TIMEOUT_S = 10.0  # how long a write waits for another app's (a second instance's) to end
WAL_RETRY_S = 0.01


@dataclass(frozen=True)
class Chat:
    id: int
    title: str
    system_prompt: str
    updated: float
    created: float = 0.0
    settings: dict = field(default_factory=dict)  # the pair and sampling it was last sent with
    context_from: int = 0  # its messages before this id are left out of requests (overflow)


@dataclass(frozen=True)
class SearchHit:
    chat: Chat
    snippet: str  # the matching message, the match in [brackets]
    in_reasoning: bool = False  # the match is in a reply's reasoning, not in its answer


@dataclass(frozen=True)
class Message:
    id: int
    chat_id: int
    role: str  # "user" | "assistant"
    content: str
    status: str  # one of STATUSES
    meta: dict = field(default_factory=dict)  # speculative, stats, per-round acceptance, reasoning, error


class StoreError(Exception):
    """A write the store refused (a full disk, a read-only file) or a damaged file; the message
    is SQLite's. `damaged`: the file itself is broken, not the disk under it."""

    def __init__(self, error: sqlite3.Error):
        super().__init__(str(error))
        self.damaged = is_damage(error)


def is_damage(error: BaseException) -> bool:
    """The file is not a database, or a damaged one (SQLite's primary codes, extended ones too)."""
    code = getattr(error, "sqlite_errorcode", None)
    return code is not None and code & 0xFF in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)


class ChatStore:
    """`path` ":memory:": a store that lasts as long as the app (when the disk's cannot be used).
    Opening raises sqlite3.Error or StoreError on a damaged, read-only or full store."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, isolation_level=None,  # we open transactions
                                   timeout=BUSY_TIMEOUT_S)
        try:
            self._open()
        except BaseException:
            self._db.close()
            raise

    def _open(self) -> None:
        self._db.row_factory = sqlite3.Row
        self._use_wal()
        self._db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: survives a killed process
        self._db.execute("PRAGMA foreign_keys=ON")
        with self._tx():  # one writer at a time: two apps opening a new store at once
            self._run_script(SCHEMA)
            self._migrate()
        # damage found now, where the app can set the file aside, not on some later send
        problems = [row[0] for row in self._db.execute("PRAGMA quick_check")]
        if problems != ["ok"]:
            damage = sqlite3.DatabaseError(f"database disk image is malformed: {problems[0]}")
            damage.sqlite_errorcode = sqlite3.SQLITE_CORRUPT  # what is_damage reads, as SQLite's own
            raise damage
        with self._tx():
            self._db.execute("UPDATE messages SET status='interrupted' WHERE status='streaming'")

    def _use_wal(self) -> None:
        """Switching a new file to WAL answers "locked" at once, without the busy timeout, while
        another app switches it too: asked again until the timeout."""
        deadline = time.monotonic() + BUSY_TIMEOUT_S
        while True:
            try:
                self._db.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as exc:
                busy = exc.sqlite_errorcode & 0xFF == sqlite3.SQLITE_BUSY
                if not busy or time.monotonic() > deadline:
                    raise
                time.sleep(WAL_RETRY_S)

    def _migrate(self) -> None:
        """Bring a store an older app wrote up to this schema (columns added, the search built, or
        built again to cover the reasoning). Runs inside the opening's write transaction, so
        what it reads is still true when it writes."""
        if "settings" not in self._columns("chats"):
            self._db.execute("ALTER TABLE chats ADD COLUMN settings TEXT NOT NULL DEFAULT '{}'")
        if "context_from" not in self._columns("chats"):
            self._db.execute("ALTER TABLE chats ADD COLUMN context_from INTEGER NOT NULL DEFAULT 0")
        if "reasoning" not in self._columns("messages"):
            self._db.execute(f"ALTER TABLE messages ADD COLUMN {REASONING_COLUMN}")
        tables = {row["name"] for row in self._db.execute("SELECT name FROM sqlite_master")}
        if "messages_fts" in tables and "reasoning" not in self._columns("messages_fts"):
            self._run_script(OLD_SEARCH_DROP + SEARCH_SCHEMA)
        elif "messages_fts" not in tables:
            self._run_script(SEARCH_SCHEMA)

    def _run_script(self, script: str) -> None:
        """Statement by statement: executescript would COMMIT the transaction this runs in."""
        statement = ""
        for line in script.splitlines(keepends=True):
            statement += line
            if sqlite3.complete_statement(statement):  # a trigger's inner ";" does not end it
                self._db.execute(statement)
                statement = ""

    def _columns(self, table: str) -> set[str]:
        """A table's columns, generated ones included (table_info leaves those out)."""
        return {row["name"] for row in self._db.execute(f"PRAGMA table_xinfo({table})")}

    def close(self) -> None:
        self._db.close()

    def _tx(self):
        return _Transaction(self._db)

    # --- chats ---

    def create_chat(self, title: str, system_prompt: str = "", created: float | None = None) -> Chat:
        now = time.time() if created is None else created
        with self._tx():
            cursor = self._db.execute(
                "INSERT INTO chats (title, system_prompt, created, updated) VALUES (?, ?, ?, ?)",
                (title, system_prompt, now, now))
        return Chat(cursor.lastrowid, title, system_prompt, now, now)

    def chats(self) -> list[Chat]:
        rows = self._db.execute("SELECT * FROM chats ORDER BY updated DESC, id DESC")
        return [_chat(row) for row in rows]

    def chat(self, chat_id: int) -> Chat:
        row = self._db.execute("SELECT * FROM chats WHERE id=?", (chat_id,)).fetchone()
        if row is None:
            raise KeyError(f"no chat {chat_id}")
        return _chat(row)

    def set_chat_settings(self, chat_id: int, settings: dict) -> None:
        with self._tx():
            self._db.execute("UPDATE chats SET settings=? WHERE id=?",
                             (json.dumps(settings), chat_id))

    def set_context_from(self, chat_id: int, message_id: int) -> None:
        """Leave the chat's messages before `message_id` out of its requests (0: none)."""
        with self._tx():
            self._db.execute("UPDATE chats SET context_from=? WHERE id=?", (message_id, chat_id))

    def search(self, query: str, limit: int = SEARCH_LIMIT) -> list[SearchHit]:
        """Chats whose messages hold every word of `query` (as word prefixes), best first."""
        words = [w.replace('"', '""') for w in query.split()]
        if not words:
            return []
        match = " ".join(f'"{word}"*' for word in words)  # quoted: no FTS5 syntax from users
        rows = self._db.execute(  # the chat with each hit, and a snippet of either column
            "SELECT c.*, snippet(messages_fts, 0, :open, :close, '…', 8) AS answer_snip, "
            "snippet(messages_fts, 1, :open, :close, '…', 8) AS reasoning_snip "
            "FROM messages_fts JOIN messages m ON m.id = messages_fts.rowid "
            "JOIN chats c ON c.id = m.chat_id WHERE messages_fts MATCH :match "
            "ORDER BY rank LIMIT :rows", {"open": MATCH_OPEN, "close": MATCH_CLOSE,
                                          "match": match, "rows": limit * 4}).fetchall()
        hits: dict[int, SearchHit] = {}
        for row in rows:
            if row["id"] not in hits and len(hits) < limit:
                hits[row["id"]] = _search_hit(row)
        return list(hits.values())

    def rename_chat(self, chat_id: int, title: str) -> None:
        with self._tx():
            self._db.execute("UPDATE chats SET title=?, updated=? WHERE id=?",
                             (title, time.time(), chat_id))

    def set_system_prompt(self, chat_id: int, system_prompt: str) -> None:
        with self._tx():
            self._db.execute("UPDATE chats SET system_prompt=? WHERE id=?", (system_prompt, chat_id))

    def delete_chat(self, chat_id: int) -> None:
        with self._tx():
            self._db.execute("DELETE FROM chats WHERE id=?", (chat_id,))

    # --- messages ---

    def add_message(self, chat_id: int, role: str, content: str, status: str = "done",
                    meta: dict | None = None) -> Message:
        with self._tx():
            return self._insert(chat_id, role, content, status, meta or {})

    def add_turn(self, chat_id: int, prompt: str, reply_meta: dict) -> tuple[Message, Message]:
        """A prompt and its reply to come (status "streaming") in one transaction: both or
        neither, so a refused write leaves no half turn."""
        with self._tx():
            return (self._insert(chat_id, "user", prompt, "done", {}),
                    self._insert(chat_id, "assistant", "", "streaming", reply_meta))

    def _insert(self, chat_id: int, role: str, content: str, status: str, meta: dict) -> Message:
        _check_status(status)
        now = time.time()
        cursor = self._db.execute(
            "INSERT INTO messages (chat_id, role, content, status, meta, created) "
            "VALUES (?, ?, ?, ?, ?, ?)", (chat_id, role, content, status, json.dumps(meta), now))
        self._db.execute("UPDATE chats SET updated=? WHERE id=?", (now, chat_id))
        return Message(cursor.lastrowid, chat_id, role, content, status, meta)

    def update_message(self, message_id: int, content: str, status: str,
                       meta: dict | None = None) -> None:
        _check_status(status)
        with self._tx():
            if meta is None:
                self._db.execute("UPDATE messages SET content=?, status=? WHERE id=?",
                                 (content, status, message_id))
            else:
                self._db.execute("UPDATE messages SET content=?, status=?, meta=? WHERE id=?",
                                 (content, status, json.dumps(meta), message_id))

    def messages(self, chat_id: int) -> list[Message]:
        rows = self._db.execute("SELECT * FROM messages WHERE chat_id=? ORDER BY id", (chat_id,))
        return [_message(row) for row in rows]

    def message(self, message_id: int) -> Message:
        row = self._db.execute("SELECT * FROM messages WHERE id=?", (message_id,)).fetchone()
        if row is None:
            raise KeyError(f"no message {message_id}")
        return _message(row)

    def delete_messages_from(self, chat_id: int, message_id: int) -> None:
        """Delete a message and every later one of its chat (regenerate, edit and resend)."""
        with self._tx():
            self._db.execute("DELETE FROM messages WHERE chat_id=? AND id>=?", (chat_id, message_id))

    def prompt_history(self, limit: int = 500) -> list[str]:
        """The user's prompts across chats, oldest first, without repeats in a row."""
        rows = self._db.execute("SELECT content FROM messages WHERE role='user' ORDER BY id DESC "
                                "LIMIT ?", (limit,)).fetchall()
        history: list[str] = []
        for row in reversed(rows):
            if not history or history[-1] != row["content"]:
                history.append(row["content"])
        return history


class _Transaction:
    """BEGIN ... COMMIT, or ROLLBACK on an exception (sqlite3 in autocommit mode). A write SQLite
    refuses comes out as StoreError, which the app reports (and keeps what the user typed)."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def __enter__(self) -> None:
        try:
            self.db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise StoreError(exc) from exc

    def __exit__(self, exc_type, exc, _traceback) -> None:
        try:
            self.db.execute("ROLLBACK" if exc_type else "COMMIT")
        except sqlite3.Error as commit_error:  # a full disk may refuse the COMMIT itself
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
            raise StoreError(exc if isinstance(exc, sqlite3.Error) else commit_error) from exc
        if isinstance(exc, sqlite3.Error):
            raise StoreError(exc) from exc


def _chat(row: sqlite3.Row) -> Chat:
    return Chat(row["id"], row["title"], row["system_prompt"], row["updated"], row["created"],
                json.loads(row["settings"]), row["context_from"])


def _search_hit(row: sqlite3.Row) -> SearchHit:
    """The answer's snippet where a word matched there, else the reasoning's."""
    in_reasoning = MATCH_OPEN not in row["answer_snip"]
    snippet = row["reasoning_snip"] if in_reasoning else row["answer_snip"]
    snippet = snippet.replace(MATCH_OPEN, "[").replace(MATCH_CLOSE, "]")
    return SearchHit(_chat(row), snippet, in_reasoning)


def _message(row: sqlite3.Row) -> Message:
    return Message(row["id"], row["chat_id"], row["role"], row["content"], row["status"],
                   json.loads(row["meta"]))


def _check_status(status: str) -> None:
    if status not in STATUSES:
        raise ValueError(f"message status {status!r} is not one of {STATUSES}")
