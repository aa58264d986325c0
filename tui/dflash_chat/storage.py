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
STATUSES = ("done", "streaming", "stopped", "interrupted", "error")
DB_NAME = "chats.sqlite3"


@dataclass(frozen=True)
class Chat:
    id: int
    title: str
    system_prompt: str
    updated: float


@dataclass(frozen=True)
class Message:
    id: int
    chat_id: int
    role: str  # "user" | "assistant"
    content: str
    status: str  # one of STATUSES
    meta: dict = field(default_factory=dict)  # speculative, stats, per-round acceptance, error


class ChatStore:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, isolation_level=None)  # we open transactions
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: survives a killed process
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(SCHEMA)
        with self._tx():
            self._db.execute("UPDATE messages SET status='interrupted' WHERE status='streaming'")

    def close(self) -> None:
        self._db.close()

    def _tx(self):
        return _Transaction(self._db)

    # --- chats ---

    def create_chat(self, title: str, system_prompt: str = "") -> Chat:
        now = time.time()
        with self._tx():
            cursor = self._db.execute(
                "INSERT INTO chats (title, system_prompt, created, updated) VALUES (?, ?, ?, ?)",
                (title, system_prompt, now, now))
        return Chat(cursor.lastrowid, title, system_prompt, now)

    def chats(self) -> list[Chat]:
        rows = self._db.execute(
            "SELECT id, title, system_prompt, updated FROM chats ORDER BY updated DESC, id DESC")
        return [Chat(row["id"], row["title"], row["system_prompt"], row["updated"]) for row in rows]

    def chat(self, chat_id: int) -> Chat:
        row = self._db.execute("SELECT id, title, system_prompt, updated FROM chats WHERE id=?",
                               (chat_id,)).fetchone()
        if row is None:
            raise KeyError(f"no chat {chat_id}")
        return Chat(row["id"], row["title"], row["system_prompt"], row["updated"])

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
        _check_status(status)
        now = time.time()
        meta = meta or {}
        with self._tx():
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


def export_markdown(chat: Chat, messages: list[Message]) -> str:
    """A chat as a Markdown document: title, system prompt, then each turn."""
    parts = [f"# {chat.title}\n"]
    if chat.system_prompt:
        parts.append(f"> System: {chat.system_prompt}\n")
    for message in messages:
        heading = "You" if message.role == "user" else "Assistant"
        if message.status not in ("done", "streaming"):
            heading += f" ({message.status})"
        parts.append(f"## {heading}\n\n{message.content}\n")
    return "\n".join(parts)


class _Transaction:
    """BEGIN ... COMMIT, or ROLLBACK on an exception (sqlite3 in autocommit mode)."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, *_exc) -> None:
        self.db.execute("ROLLBACK" if exc_type else "COMMIT")


def _message(row: sqlite3.Row) -> Message:
    return Message(row["id"], row["chat_id"], row["role"], row["content"], row["status"],
                   json.loads(row["meta"]))


def _check_status(status: str) -> None:
    if status not in STATUSES:
        raise ValueError(f"message status {status!r} is not one of {STATUSES}")
