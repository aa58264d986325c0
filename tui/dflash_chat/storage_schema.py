"""The chat store's schema and its migrations: an older app's store brought up to this one.

Boundary: sqlite3 only. `migrate` runs inside the opening's write transaction (storage.py), so
what it reads is still true when it writes, and two apps opening one store at once are safe.
"""

from __future__ import annotations

import sqlite3

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
CREATE TABLE IF NOT EXISTS presets (
    name TEXT PRIMARY KEY,
    system_prompt TEXT NOT NULL DEFAULT '',
    settings TEXT NOT NULL DEFAULT '{}',
    updated REAL NOT NULL
);
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


def migrate(db: sqlite3.Connection) -> None:
    """Columns added, the search built (or built again to cover the reasoning), the messages
    of a store from before branches linked in their order (each to the one before it)."""
    chats, messages = columns(db, "chats"), columns(db, "messages")
    if "settings" not in chats:
        db.execute("ALTER TABLE chats ADD COLUMN settings TEXT NOT NULL DEFAULT '{}'")
    if "context_from" not in chats:
        db.execute("ALTER TABLE chats ADD COLUMN context_from INTEGER NOT NULL DEFAULT 0")
    if "context_summary" not in chats:  # the model's summary of the turns left out
        db.execute("ALTER TABLE chats ADD COLUMN context_summary TEXT NOT NULL DEFAULT ''")
    if "head_id" not in chats:  # the last message of the branch shown (NULL: the newest)
        db.execute("ALTER TABLE chats ADD COLUMN head_id INTEGER")
    if "parent_id" not in messages:  # before branches, each message followed the one before
        db.execute("ALTER TABLE messages ADD COLUMN parent_id INTEGER "
                   "REFERENCES messages(id) ON DELETE CASCADE")
        db.execute("UPDATE messages SET parent_id = (SELECT MAX(p.id) FROM messages p "
                   "WHERE p.chat_id = messages.chat_id AND p.id < messages.id)")
    db.execute("CREATE INDEX IF NOT EXISTS messages_by_parent ON messages(parent_id)")
    if "reasoning" not in messages:
        db.execute(f"ALTER TABLE messages ADD COLUMN {REASONING_COLUMN}")
    tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master")}
    if "messages_fts" in tables and "reasoning" not in columns(db, "messages_fts"):
        run_script(db, OLD_SEARCH_DROP + SEARCH_SCHEMA)
    elif "messages_fts" not in tables:
        run_script(db, SEARCH_SCHEMA)


def run_script(db: sqlite3.Connection, script: str) -> None:
    """Statement by statement: executescript would COMMIT the transaction this runs in."""
    statement = ""
    for line in script.splitlines(keepends=True):
        statement += line
        if sqlite3.complete_statement(statement):  # a trigger's inner ";" does not end it
            db.execute(statement)
            statement = ""


def columns(db: sqlite3.Connection, table: str) -> set[str]:
    """A table's columns, generated ones included (table_info leaves those out)."""
    return {row[1] for row in db.execute(f"PRAGMA table_xinfo({table})")}
