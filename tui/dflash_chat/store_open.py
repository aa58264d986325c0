"""Opening the chat history whatever the disk holds, so the app always starts and says why when
it cannot use the file: a damaged file is set aside under a timestamped name beside it and a
new history starts; a history that cannot be written (a read-only file or folder, a full disk)
is left as it is and the app keeps this session's chats in memory.

Boundary: no Textual; storage.py owns the schema and the writes.
"""

from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from dflash_chat.storage import ChatStore, StoreError, is_damage

STORE_FILE_SUFFIXES = ("", "-wal", "-shm")  # a store and its WAL files move together
OPEN_ERRORS = (sqlite3.Error, StoreError, OSError)


@dataclass(frozen=True)
class OpenedStore:
    store: ChatStore
    problem: str | None = None  # what the user is told when the history on disk is not in use


def open_store(path: Path) -> OpenedStore:
    try:
        return OpenedStore(ChatStore(path))
    except OPEN_ERRORS as exc:
        if getattr(exc, "damaged", False) or is_damage(exc):
            return _replace_damaged(path, exc)
        return _in_memory(f"The chat history {path} cannot be written ({exc})")


def damaged_copy_path(path: Path, now: float | None = None) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return path.with_name(f"{path.name}.damaged-{stamp}")


def _replace_damaged(path: Path, error: BaseException) -> OpenedStore:
    """Move the damaged file (and its WAL files) aside, then start a new history in its place."""
    copy = damaged_copy_path(path)
    try:
        for suffix in STORE_FILE_SUFFIXES:
            if Path(f"{path}{suffix}").exists():
                os.replace(f"{path}{suffix}", f"{copy}{suffix}")
    except OSError as exc:
        return _in_memory(f"The chat history {path} is damaged ({error}) and could not be set "
                          f"aside ({exc})")
    told = f"The chat history {path} was damaged ({error}). It is kept as {copy.name}"
    try:
        return OpenedStore(ChatStore(path), f"{told}; a new history starts.")
    except OPEN_ERRORS as exc:
        return _in_memory(f"{told}, and a new one cannot be written ({exc})")


def _in_memory(reason: str) -> OpenedStore:
    return OpenedStore(ChatStore(":memory:"),
                       f"{reason}: this session's chats are kept in memory only, until you quit.")
