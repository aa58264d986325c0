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

from dflash_chat.storage_schema import SCHEMA, migrate, run_script

MATCH_OPEN, MATCH_CLOSE = "\x02", "\x03"  # snippet marks, shown as [ ]: no text holds them
SEARCH_LIMIT = 50
STATUSES = ("done", "streaming", "stopped", "interrupted", "error")
DB_NAME = "chats.sqlite3"
HEAD = -1  # a new message's parent: the last message of the branch shown
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
    head_id: int | None = None  # the last message of the branch shown (None: the newest)
    context_summary: str = ""  # the summarise policy: what the turns before context_from said


@dataclass(frozen=True)
class SearchHit:
    chat: Chat
    snippet: str  # the matching message, the match in [brackets]
    in_reasoning: bool = False  # the match is in a reply's reasoning, not in its answer
    marked: str = ""  # the snippet with each match between MATCH_OPEN and MATCH_CLOSE
    message_id: int = 0  # the message it is in (any branch)

    def parts(self) -> list[tuple[str, bool]]:
        """The snippet as (text, is a match) runs: a bracket of the text itself stays text."""
        runs: list[tuple[str, bool]] = []
        for index, piece in enumerate(self.marked.split(MATCH_OPEN)):
            match, _, rest = piece.partition(MATCH_CLOSE) if index else ("", "", piece)
            runs += [(text, is_match) for text, is_match in ((match, True), (rest, False)) if text]
        return runs


@dataclass(frozen=True)
class Message:
    id: int
    chat_id: int
    role: str  # "user" | "assistant"
    content: str
    status: str  # one of STATUSES
    meta: dict = field(default_factory=dict)  # speculative, stats, per-round acceptance, reasoning, error
    parent_id: int | None = None  # the message it answers or follows (None: the chat's first)


@dataclass(frozen=True)
class Preset:
    name: str
    system_prompt: str
    settings: dict  # a chat's own values (settings.CHAT_FIELDS)


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
            run_script(self._db, SCHEMA)
            migrate(self._db)
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

    def set_context_from(self, chat_id: int, message_id: int, summary: str = "") -> None:
        """Leave the chat's messages before `message_id` out of its requests (0: none), with
        `summary` of them sent in their place."""
        with self._tx():
            self._db.execute("UPDATE chats SET context_from=?, context_summary=? WHERE id=?",
                             (message_id, summary, chat_id))

    def search(self, query: str, limit: int = SEARCH_LIMIT) -> list[SearchHit]:
        """Chats whose messages hold every word of `query` (as word prefixes), best first."""
        words = [w.replace('"', '""') for w in query.split()]
        if not words:
            return []
        match = " ".join(f'"{word}"*' for word in words)  # quoted: no FTS5 syntax from users
        rows = self._db.execute(  # the chat with each hit, and a snippet of either column
            "SELECT c.*, m.id AS message_id, "
            "snippet(messages_fts, 0, :open, :close, '…', 8) AS answer_snip, "
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
                    meta: dict | None = None, parent: int | None = HEAD) -> Message:
        """A message after `parent` (HEAD: the branch shown; another: a new version of that
        message's answer or follow-up); it becomes the end of the branch shown."""
        with self._tx():
            return self._insert(chat_id, role, content, status, meta or {}, parent)

    def add_turn(self, chat_id: int, prompt: str, reply_meta: dict,
                 parent: int | None = HEAD) -> tuple[Message, Message]:
        """A prompt and its reply to come (status "streaming") in one transaction: both or
        neither, so a refused write leaves no half turn."""
        with self._tx():
            user = self._insert(chat_id, "user", prompt, "done", {}, parent)
            return user, self._insert(chat_id, "assistant", "", "streaming", reply_meta, user.id)

    def _insert(self, chat_id: int, role: str, content: str, status: str, meta: dict,
                parent: int | None) -> Message:
        _check_status(status)
        now = time.time()
        parent = self._head(chat_id) if parent == HEAD else parent
        cursor = self._db.execute(
            "INSERT INTO messages (chat_id, role, content, status, meta, created, parent_id) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (chat_id, role, content, status, json.dumps(meta), now, parent))
        self._db.execute("UPDATE chats SET updated=?, head_id=? WHERE id=?",
                         (now, cursor.lastrowid, chat_id))
        return Message(cursor.lastrowid, chat_id, role, content, status, meta, parent)

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
        """The branch shown: its last message and every one before it, oldest first."""
        rows = self._db.execute(
            "WITH RECURSIVE branch(id) AS (SELECT ? UNION ALL SELECT m.parent_id FROM messages m "
            "JOIN branch ON m.id = branch.id WHERE m.parent_id IS NOT NULL) "
            "SELECT messages.* FROM messages JOIN branch USING (id) ORDER BY id",
            (self._head(chat_id),))
        return [_message(row) for row in rows]

    def all_messages(self, chat_id: int) -> list[Message]:
        """Every message of every branch, oldest first."""
        rows = self._db.execute("SELECT * FROM messages WHERE chat_id=? ORDER BY id", (chat_id,))
        return [_message(row) for row in rows]

    def _head(self, chat_id: int) -> int | None:
        row = self._db.execute(
            "SELECT COALESCE((SELECT m.id FROM chats c JOIN messages m ON m.id = c.head_id "
            "WHERE c.id = :chat), (SELECT MAX(id) FROM messages WHERE chat_id = :chat))",
            {"chat": chat_id}).fetchone()
        return row[0]

    def versions(self, chat_id: int) -> dict[int, tuple[int, int]]:
        """For each message that has other versions (the answers or follow-ups of one parent):
        (its place among them, how many), oldest first."""
        siblings: dict[int | None, list[int]] = {}
        for row in self._db.execute("SELECT id, parent_id FROM messages WHERE chat_id=? "
                                    "ORDER BY id", (chat_id,)):
            siblings.setdefault(row["parent_id"], []).append(row["id"])
        return {message: (place, len(group)) for group in siblings.values() if len(group) > 1
                for place, message in enumerate(group, 1)}

    def versions_of(self, message_id: int) -> list[int]:
        """The message and its other versions (the same parent's), oldest first."""
        message = self.message(message_id)
        return [row[0] for row in self._db.execute(
            "SELECT id FROM messages WHERE chat_id=? AND parent_id IS ? ORDER BY id",
            (message.chat_id, message.parent_id))]

    def show_version(self, chat_id: int, message_id: int) -> None:
        """Show the branch through `message_id`, to its newest end; what was left out of the
        context is counted again on the next send."""
        head = message_id
        while (child := self._db.execute("SELECT MAX(id) FROM messages WHERE parent_id=?",
                                         (head,)).fetchone()[0]) is not None:
            head = child
        with self._tx():
            self._db.execute("UPDATE chats SET head_id=?, context_from=0, context_summary='' "
                             "WHERE id=?",
                             (head, chat_id))

    def message(self, message_id: int) -> Message:
        row = self._db.execute("SELECT * FROM messages WHERE id=?", (message_id,)).fetchone()
        if row is None:
            raise KeyError(f"no message {message_id}")
        return _message(row)

    def delete_messages_from(self, chat_id: int, message_id: int) -> None:
        """Delete a message and every one that follows it, in every branch (the branch shown
        then ends before it)."""
        with self._tx():
            parent = self._db.execute("SELECT parent_id FROM messages WHERE id=? AND chat_id=?",
                                      (message_id, chat_id)).fetchone()
            self._db.execute("DELETE FROM messages WHERE id=?", (message_id,))  # cascades
            self._db.execute("UPDATE chats SET head_id=? WHERE id=?",
                             (parent[0] if parent else None, chat_id))

    # --- presets: named system prompt and sampling, the user's ---

    def save_preset(self, preset: Preset) -> None:
        """Store it, or replace the one of that name."""
        with self._tx():
            self._db.execute("INSERT OR REPLACE INTO presets (name, system_prompt, settings, "
                             "updated) VALUES (?, ?, ?, ?)", (preset.name, preset.system_prompt,
                                                              json.dumps(preset.settings),
                                                              time.time()))

    def presets(self) -> list[Preset]:
        rows = self._db.execute("SELECT * FROM presets ORDER BY name COLLATE NOCASE")
        return [Preset(row["name"], row["system_prompt"], json.loads(row["settings"]))
                for row in rows]

    def delete_preset(self, name: str) -> None:
        with self._tx():
            self._db.execute("DELETE FROM presets WHERE name=?", (name,))

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
                json.loads(row["settings"]), row["context_from"], row["head_id"],
                row["context_summary"])


def _search_hit(row: sqlite3.Row) -> SearchHit:
    """The answer's snippet where a word matched there, else the reasoning's."""
    in_reasoning = MATCH_OPEN not in row["answer_snip"]
    marked = row["reasoning_snip"] if in_reasoning else row["answer_snip"]
    snippet = marked.replace(MATCH_OPEN, "[").replace(MATCH_CLOSE, "]")
    return SearchHit(_chat(row), snippet, in_reasoning, marked, row["message_id"])


def _message(row: sqlite3.Row) -> Message:
    return Message(row["id"], row["chat_id"], row["role"], row["content"], row["status"],
                   json.loads(row["meta"]), row["parent_id"])


def _check_status(status: str) -> None:
    if status not in STATUSES:
        raise ValueError(f"message status {status!r} is not one of {STATUSES}")
