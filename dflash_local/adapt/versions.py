"""Adapted drafters: the versions one pair's drafter has been through, under the data dir.

Boundary: files only (publish, find the serving version, history, reset); which version to make
and when is `adapt/idle.py`'s. Layout, per pair key (adapt/store.py's):

    adapt/drafters/<pair key>/v0003/   config.json, model.safetensors, draft_vocab.json (z-lab's
                                       format: every engine and z-lab's dflash package load it)
                                       and version.json (what made it, each file's sha256)
    adapt/drafters/<pair key>/serving.json   {"version": 3}: absent, the shipped drafter serves

A version is written under a temporary name and renamed whole, then serving.json is replaced
(`os.replace`): a kill at any point leaves the previous pointer or the new one, each naming a
complete directory. A version whose files fail their checksums, or one made for another target,
is skipped with one log line for the newest good one below it. The shipped drafter's directory is
only ever read.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dflash_local import paths
from dflash_local.adapt.store import STORE_DIR
from dflash_local.errors import CheckpointError

log = logging.getLogger("dflash_local.adapt")
VERSIONS_DIR = "drafters"
POINTER = "serving.json"
RECORD = "version.json"
PROGRESS = "progress.json"
VERSION_NAME = re.compile(r"^v(\d{4,})$")
PARTIAL_PREFIX = ".partial-"


def versions_root() -> Path:
    return paths.data_dir_path() / STORE_DIR / VERSIONS_DIR


@dataclass(frozen=True)
class Version:
    number: int
    path: Path
    record: dict  # version.json: trained_on, tau_before, tau_after, at, target, files

    def history_entry(self) -> dict:
        """The /dflash/status history item (the status contract)."""
        record = self.record
        return {"version": self.number, "trained_on": record["trained_on"],
                "tau_before": record["tau_before"], "tau_after": record["tau_after"],
                "at": record["at"]}


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(f"{PARTIAL_PREFIX}{path.name}.{os.getpid()}")
    with partial.open("w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)


class VersionStore:
    """One pair's versions. `target`: the target's identity (files_signature) the versions must
    have been made for."""

    def __init__(self, pair_key: str, target: dict, root: Path | None = None):
        self.pair_key = pair_key
        self.target = json.loads(json.dumps(target, default=str))
        self.dir = (root or versions_root()) / pair_key
        self._pointer_read: tuple[tuple, int | None] | None = None  # (the file's stat, its version)
        self._sweep_partials()

    def _sweep_partials(self) -> None:
        """What a kill left half-written: never named a version, never pointed at."""
        if not self.dir.is_dir():
            return
        for leftover in self.dir.glob(PARTIAL_PREFIX + "*"):
            shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink(missing_ok=True)

    def numbers(self) -> list[int]:
        """Every version directory's number, oldest first (checked or not)."""
        if not self.dir.is_dir():
            return []
        found = (VERSION_NAME.match(entry.name) for entry in self.dir.iterdir())
        return sorted(int(match.group(1)) for match in found if match)

    def path_of(self, number: int) -> Path:
        return self.dir / f"v{number:04d}"

    def publish(self, write_drafter: Callable[[Path], None], record: dict) -> Version:
        """A new version: `write_drafter(directory)` writes the drafter's files, `record` says
        what made it; then it serves (the pointer names it)."""
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        number = max(self.numbers(), default=0) + 1
        partial = self.dir / f"{PARTIAL_PREFIX}v{number:04d}.{os.getpid()}"
        partial.mkdir()
        write_drafter(partial)
        files = {path.name: paths.file_sha256(path) for path in sorted(partial.iterdir())}
        full = {**record, "version": number, "pair": self.pair_key, "target": self.target,
                "files": files}
        _write_atomically(partial / RECORD, json.dumps(full, indent=2, default=str) + "\n")
        final = self.path_of(number)
        os.rename(partial, final)
        self.serve(number)
        return Version(number, final, full)

    def serve(self, number: int | None) -> None:
        """Point at version `number` (None: the shipped drafter)."""
        if number is None:
            (self.dir / POINTER).unlink(missing_ok=True)
            return
        _write_atomically(self.dir / POINTER, json.dumps({"version": number}) + "\n")

    def pointed(self) -> int | None:
        """The version the pointer names, unchecked (None: none, or a pointer unreadable). The
        idle worker asks before every slice: the file is parsed again only when its stat changes
        (each write is a new file: `os.replace`)."""
        try:
            stat = (self.dir / POINTER).stat()
        except FileNotFoundError:
            self._pointer_read = None
            return None
        seen = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if self._pointer_read is None or self._pointer_read[0] != seen:
            self._pointer_read = (seen, self._parse_pointer())
        return self._pointer_read[1]

    def _parse_pointer(self) -> int | None:
        try:
            return int(json.loads((self.dir / POINTER).read_text())["version"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("%s is unreadable (%s): the newest good version serves", self.dir / POINTER, exc)
            return max(self.numbers(), default=None)

    def check(self, number: int) -> Version:
        """Version `number` as it is on disk, its files checked; CheckpointError naming what failed."""
        path = self.path_of(number)
        try:
            record = json.loads((path / RECORD).read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"adapted drafter {path}: {RECORD} unreadable ({exc})") from None
        if record.get("target") != self.target:
            raise CheckpointError(
                f"adapted drafter {path} was made for another target ({_described(record.get('target'))}) "
                f"than the one loaded ({_described(self.target)}): refused")
        present = {entry.name for entry in path.iterdir()} - {RECORD}
        if present != set(record.get("files", {})):
            raise CheckpointError(f"adapted drafter {path}: files {sorted(present)} are not the "
                                  f"ones recorded ({sorted(record.get('files', {}))})")
        for name, digest in record["files"].items():
            if paths.file_sha256(path / name) != digest:
                raise CheckpointError(f"adapted drafter {path}: {name} fails its checksum (corrupt)")
        return Version(number, path, record)

    def serving(self) -> Version | None:
        """The version to serve: the pointed one, or the newest good one below it when it fails
        its checks (each failure logged once here); None: the shipped drafter."""
        pointed = self.pointed()
        if pointed is None:
            return None
        for number in sorted((n for n in self.numbers() if n <= pointed), reverse=True):
            try:
                return self.check(number)
            except CheckpointError as exc:
                log.warning("%s; skipped", exc)
        return None

    def history(self) -> list[dict]:
        """Every readable version's history entry, oldest first."""
        entries = []
        for number in self.numbers():
            try:
                record = json.loads((self.path_of(number) / RECORD).read_text())
            except (OSError, ValueError):
                continue
            entries.append(Version(number, self.path_of(number), record).history_entry())
        return entries

    def taken_through(self) -> int:
        """The last recorded reply's row id adaptation's rounds have taken in (0: none)."""
        try:
            return int(json.loads((self.dir / PROGRESS).read_text())["taken_through"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0

    def save_taken_through(self, reply_id: int) -> None:
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        _write_atomically(self.dir / PROGRESS, json.dumps({"taken_through": reply_id}) + "\n")

    def offline_status(self, replies: int, pending: int) -> dict:
        """The status contract's fields as files tell them, with no service: whether a round
        runs and the recent τ only a serving process knows (None)."""
        version = self.serving()
        return {"enabled": None, "recording": None, "replies": replies, "pending": pending,
                "training": None, "version": version.number if version else None,
                "trained_on": replies - pending, "tau_recent": {"shipped": None, "serving": None},
                "last_round": None, "history": self.history()}

    def reset(self) -> int:
        """Back to the shipped drafter: every version of this pair deleted; returns how many."""
        count = len(self.numbers())
        self.serve(None)
        shutil.rmtree(self.dir, ignore_errors=True)
        return count


def reset_versions(pair_key: str | None = None) -> int:
    """`adapt reset`: every pair's versions (or one pair's) deleted; returns how many. A service
    serving one goes back to the shipped drafter at its next idle moment (idle.py follows the
    pointer)."""
    root = versions_root()
    dirs = [root / pair_key] if pair_key else (sorted(root.iterdir()) if root.is_dir() else [])
    return sum(VersionStore(path.name, {}, root).reset() for path in dirs if path.is_dir())


def _described(target: dict | None) -> str:
    return Path(target["path"]).name if isinstance(target, dict) and target.get("path") else str(target)


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
