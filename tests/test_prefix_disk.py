"""The prefix cache's disk tier as a policy (method/prefix_disk.py, prefix_disk_format.py), on
numpy states: a state packs and unpacks whole; a torn write (a temporary file, a payload whose
manifest never came, a truncated payload) is never loaded; the budget evicts the least recently
used entries; two processes writing one directory leave only whole entries; the budgets a user
gives are checked (against the free space and what the cache holds), and a directory that cannot
be written leaves the engine RAM-only; states are packed on the writer's thread; the index is
read again only when the directory changed; `close` stops the writer and its exit hook."""

from __future__ import annotations

import errno
import logging
import multiprocessing
import os
import shutil
import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest

from dflash_local.errors import InvalidRequestError
from dflash_local.method import prefix_disk
from dflash_local.method.prefix_cache import MIB, Kept
from dflash_local.method.prefix_disk import DiskTier, disk_budget_bytes, make_disk_tier
from dflash_local.method.prefix_disk_format import MANIFEST, pack, unpack

IDENTITY = {"engine": "numpy", "target": "t", "drafter": "d"}


@dataclass(frozen=True)
class Layer:
    keys: np.ndarray
    end: int


class NumpyCodec:
    """Numpy arrays stand for a framework's; `Layer` for its state objects."""

    identity = "numpy"

    def to_numpy(self, value):
        return (value, str(value.dtype)) if isinstance(value, np.ndarray) else None

    def from_numpy(self, array, dtype):
        return np.array(array, dtype=dtype)

    def to_tag(self, value):
        return "dtype:" + value.name if isinstance(value, np.dtype) else None

    def from_tag(self, tag):
        return np.dtype(tag.removeprefix("dtype:"))

    def object_type(self, name):
        return Layer if name == "Layer" else None


def kept(rows: int, width: int = 64) -> Kept:
    state = {"layers": [Layer(np.full((rows, width), rows, np.float32), rows), None],
             "pair": (1, "two", 3.0), "dtype": np.dtype("float16"), "keys": {0: True}}
    return Kept(state, rows * width * 4)


def tier(root, budget=64 * MIB, identity=IDENTITY) -> DiskTier:
    return DiskTier(root, identity, budget, NumpyCodec())


def written(disk: DiskTier, ids: list[int], rows: int | None = None) -> None:
    disk.submit(ids, kept(rows or len(ids)))
    disk.flush()


def test_a_state_packs_and_unpacks_whole():
    state = kept(5).state
    skeleton, arrays = pack(state, NumpyCodec())
    back = unpack(skeleton, arrays, NumpyCodec())
    assert back["pair"] == (1, "two", 3.0) and back["dtype"] == np.dtype("float16")
    assert back["keys"] == {0: True} and back["layers"][1] is None
    assert back["layers"][0].end == 5
    np.testing.assert_array_equal(back["layers"][0].keys, state["layers"][0].keys)


def test_an_entry_comes_back_after_a_restart(tmp_path):
    written(tier(tmp_path), list(range(10)))
    restarted = tier(tmp_path)
    name, rows = restarted.lookup(list(range(12)), needs_taps=False)
    assert rows == 10
    entry = restarted.load(name)
    assert entry.kept.nbytes == kept(10).nbytes
    np.testing.assert_array_equal(entry.kept.state["layers"][0].keys, np.full((10, 64), 10))
    assert tier(tmp_path, identity={**IDENTITY, "dtype": "bf16"}).lookup(
        list(range(12)), needs_taps=False) is None  # another pair: another directory


def test_a_torn_write_is_never_loaded(tmp_path, caplog):
    disk = tier(tmp_path)
    written(disk, list(range(10)))
    (manifest,) = [path for path in disk.directory.glob("*.json") if path.name != "pair.json"]
    payload = manifest.with_suffix(".safetensors")
    data = payload.read_bytes()
    # a crash before the rename: a temporary file of a dead process, no manifest
    (disk.directory / f"{manifest.stem}x.safetensors.999999.tmp").write_bytes(data[:100])
    # a crash between the renames: a payload whose manifest never came (an old one)
    orphan = disk.directory / "orphan.safetensors"
    orphan.write_bytes(data)
    os.utime(orphan, (time.time() - 2 * prefix_disk.ORPHAN_AGE_S,) * 2)
    payload.write_bytes(data[: len(data) // 2])  # a truncated payload under its manifest
    restarted = tier(tmp_path)
    assert not list(disk.directory.glob("*.tmp")) and not orphan.exists()  # swept at start
    name, _ = restarted.lookup(list(range(12)), needs_taps=False)
    with caplog.at_level(logging.WARNING, logger="dflash_local.method.prefix_disk"):
        assert restarted.load(name) is None
    assert "bytes, its manifest says" in caplog.text
    assert not payload.exists() and not manifest.exists()
    assert restarted.lookup(list(range(12)), needs_taps=False) is None


def test_a_manifest_that_is_not_one_is_dropped(tmp_path, caplog):
    disk = tier(tmp_path)
    written(disk, list(range(10)))
    (disk.directory / "broken.json").write_text('{"pair": "x", "tok')
    with caplog.at_level(logging.WARNING, logger="dflash_local.method.prefix_disk"):
        assert tier(tmp_path).lookup(list(range(12)), needs_taps=False)[1] == 10
    assert "not a manifest" in caplog.text and not (disk.directory / "broken.json").exists()


def test_the_budget_evicts_the_least_recently_used_entries(tmp_path):
    entry_bytes = 40 * 64 * 4  # and a small header and manifest
    disk = tier(tmp_path, budget=int(2.5 * entry_bytes))
    conversations = [[start] * 40 for start in (1, 2, 3)]
    written(disk, conversations[0])
    written(disk, conversations[1])
    name, _ = disk.lookup(conversations[0] + [9], needs_taps=False)
    time.sleep(0.01)  # mtimes order the LRU: the first conversation is now the latest used
    disk.load(name)
    written(disk, conversations[2])
    found = {tuple(entry.token_ids.tolist()) for entry in tier(tmp_path).entries().values()}
    assert found == {tuple(conversations[0]), tuple(conversations[2])}
    assert sum(size for _, size in prefix_disk.entry_files(tmp_path)) <= disk.budget


def test_an_entry_the_new_one_extends_is_replaced(tmp_path):
    disk = tier(tmp_path)
    written(disk, list(range(10)))
    written(disk, list(range(20)))
    assert [len(entry.token_ids) for entry in disk.entries().values()] == [20]


def _write_many(root, start: int) -> None:
    disk = tier(root, budget=6 * 30 * 64 * 4)
    for index in range(12):
        written(disk, [start, index] * 15)


def test_two_processes_on_one_directory_leave_only_whole_entries(tmp_path):
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_write_many, args=(tmp_path, start)) for start in (1, 2)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(120)
    assert [writer.exitcode for writer in writers] == [0, 0]
    disk = tier(tmp_path)
    names = list(disk.entries())
    assert names and not list(tmp_path.glob("*/*.tmp"))
    assert all(disk.load(name) is not None for name in names)


def test_budgets_given_are_checked(tmp_path, monkeypatch):
    assert disk_budget_bytes(0, tmp_path) == 0
    with pytest.raises(InvalidRequestError, match="--prefix-cache-disk-mb must be >= 0"):
        disk_budget_bytes(-1, tmp_path)
    with pytest.raises(InvalidRequestError, match=r"--prefix-cache-disk-mb 1000000000 is more "
                                                  r"than the free space of .* \(\d+ MiB\)"):
        disk_budget_bytes(10**9, tmp_path)
    monkeypatch.setattr(prefix_disk, "DEFAULT_DISK_MB", 2048)  # conftest turns it off
    assert 0 < disk_budget_bytes(None, tmp_path) <= 2048 * MIB


def test_a_directory_that_cannot_be_written_leaves_ram_only(tmp_path, caplog):
    root = tmp_path / "prefix-cache"
    root.write_text("a file where the directory should be")
    with caplog.at_level(logging.WARNING, logger="dflash_local.method.prefix_disk"):
        assert make_disk_tier(root, IDENTITY, 64 * MIB, NumpyCodec()) is None
    assert "cannot be written" in caplog.text and "RAM only" in caplog.text
    assert make_disk_tier(tmp_path / "ok", IDENTITY, 0, NumpyCodec()) is None  # 0: off


def _write_until_killed(root, started) -> None:
    disk = tier(root, budget=64 * MIB)
    for index in range(10_000):
        written(disk, [index % 7 + 1, index] * 8, rows=2048 + index % 5 * 512)  # 0.5-1 MB each
        started.set()


def test_kill_9_during_writes_leaves_only_whole_entries(tmp_path):
    """A writer killed at random moments, 20 times: the next start loads every entry it finds,
    each the state that was written (its rows hold their count), and no temporary file outlives
    it."""
    context = multiprocessing.get_context("spawn")
    random = np.random.default_rng(0)
    for _ in range(20):
        started = context.Event()
        writer = context.Process(target=_write_until_killed, args=(tmp_path, started))
        writer.start()
        assert started.wait(60)
        time.sleep(float(random.uniform(0, 0.2)))  # a random moment of its writes
        writer.kill()
        writer.join()
    disk = tier(tmp_path)
    assert not list(tmp_path.glob("*/*.tmp"))
    names = list(disk.entries())
    assert names
    for name in names:
        (layer, _none) = disk.load(name).kept.state["layers"]
        assert layer.keys.shape == (layer.end, 64) and np.all(layer.keys == layer.end)


def test_a_full_disk_stops_the_writes_and_says_so_once(tmp_path, monkeypatch, caplog):
    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(prefix_disk, "write_entry", full)
    disk = tier(tmp_path)
    with caplog.at_level(logging.WARNING, logger="dflash_local.method.prefix_disk"):
        written(disk, list(range(10)))
        written(disk, list(range(20)))
    assert caplog.text.count("is full") == 1
    assert "full" in disk.status()["note"] and disk.status()["entries"] == 0


def test_a_budget_counts_the_space_the_cache_holds_as_free(tmp_path, monkeypatch):
    written(tier(tmp_path), list(range(10)), rows=16384)  # a 4 MiB entry
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(prefix_disk.shutil, "disk_usage",
                        lambda path: usage._replace(free=MIB))  # 1 MiB left besides the cache
    assert disk_budget_bytes(5, tmp_path) == 5 * MIB  # the entry can be evicted for new ones
    with pytest.raises(InvalidRequestError, match=r"--prefix-cache-disk-mb 6 is more than the "
                                                  r"free space of .* \(5 MiB\)"):
        disk_budget_bytes(6, tmp_path)


def test_states_are_packed_on_the_writer_thread(tmp_path, monkeypatch):
    packed_on = []

    def pack_recorded(state, codec):
        packed_on.append(threading.current_thread().name)
        return pack(state, codec)

    monkeypatch.setattr(prefix_disk, "pack", pack_recorded)
    disk = tier(tmp_path)
    written(disk, list(range(10)))
    assert packed_on == ["prefix-disk"] and len(disk.entries()) == 1


def test_the_index_is_read_again_only_when_the_directory_changes(tmp_path, monkeypatch):
    writer, reader = tier(tmp_path), tier(tmp_path)
    written(writer, list(range(10)))
    reads = []
    listing = prefix_disk.manifest_names
    monkeypatch.setattr(prefix_disk, "manifest_names", lambda path: reads.append(path) or listing(path))
    old = time.time() - 3600  # a settled directory: no change can hide in its clock tick
    os.utime(reader.directory, (old, old))
    for _ in range(3):
        assert reader.lookup(list(range(12)), needs_taps=False)[1] == 10
    assert len(reads) == 1
    written(writer, list(range(100, 130)))  # another process's entry: the directory changes
    assert reader.lookup(list(range(100, 140)), needs_taps=False)[1] == 30
    assert len(reads) == 2


def test_close_writes_what_is_queued_then_stops_the_writer_and_its_exit_hook(tmp_path, monkeypatch):
    hooks = []
    monkeypatch.setattr(prefix_disk.atexit, "register", hooks.append)
    monkeypatch.setattr(prefix_disk.atexit, "unregister", hooks.remove)

    def writers() -> int:
        return sum(thread.name == "prefix-disk" for thread in threading.enumerate())

    before = writers()
    disks = [tier(tmp_path) for _ in range(3)]
    assert writers() == before + 3 and len(hooks) == 3
    disks[0].submit(list(range(10)), kept(10))
    for disk in disks:
        disk.close()
    assert writers() == before and hooks == []
    disks[0].submit(list(range(20)), kept(20))  # after close: ignored
    assert [len(entry.token_ids) for entry in tier(tmp_path).entries().values()] == [10]


def test_recent_gives_the_latest_used_entries_within_a_size(tmp_path):
    disk = tier(tmp_path)
    for start in (1, 2, 3):
        written(disk, [start] * 40)
    # each entry's last use set apart (a load touches its manifest), not in the order written
    last_used = {1: 300, 2: 100, 3: 200}
    for name, entry in disk.entries().items():
        when = time.time() - 3600 + last_used[int(entry.token_ids[0])]
        os.utime(disk.directory / (name + MANIFEST), (when, when))
    latest = [disk.entries()[name].token_ids[0] for name in disk.recent(2, 64 * MIB)]
    assert latest == [1, 3]
    assert [disk.entries()[name].token_ids[0] for name in disk.recent(5, kept(40).nbytes)] == [1]
