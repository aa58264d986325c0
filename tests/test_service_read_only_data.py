"""The service on a data folder it cannot write, with the real faults (a read-only tmpfs, a
full one): a pair still loads and calibrates (the calibration is kept in memory, its cache
skipped with a warning), and the embedded import is refused with an error that says where and
what to do, leaving nothing behind. The mounts need root; elsewhere these tests skip."""

from __future__ import annotations

import errno
import logging
import subprocess

import pytest
from service_support import make_pair, torch_loader


def mount(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *args], check=False, capture_output=True, text=True)


@pytest.fixture
def disk(tmp_path):
    """A 1 MiB tmpfs, unmounted after the test."""
    path = tmp_path / "disk"
    path.mkdir()
    mounted = mount("-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path))
    if mounted.returncode != 0:
        pytest.skip(f"no tmpfs here: {mounted.stderr.strip()}")
    yield path
    subprocess.run(["umount", "-l", str(path)], check=True)


def read_only(disk):
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    return disk / "home"  # absent, and it cannot be made


def full(disk):
    home = disk / "home"
    home.mkdir()
    try:
        with (disk / "filler").open("wb") as filler:
            while True:
                filler.write(b"\0" * 65536)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    return home


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("pair"))


@pytest.mark.parametrize("fault", [read_only, full])
def test_a_pair_loads_and_calibrates_where_nothing_can_be_written(disk, pair, fault, monkeypatch,
                                                                    caplog):
    from dflash_local.service.state import ServiceState

    monkeypatch.setenv("DFLASH_LOCAL_HOME", str(fault(disk)))
    state = ServiceState(loader=torch_loader, hub_cache_dir=disk)
    with caplog.at_level(logging.WARNING):
        loaded = state.load("transformers", *map(str, pair), served_name="tiny")
    try:
        assert loaded.engine.calibration is not None  # measured, and kept for this load
        assert "could not be cached" in caplog.text, caplog.text
        assert not list(disk.rglob("*.json")), "nothing was written"
    finally:
        state.shutdown()


def test_the_embedded_import_says_where_it_cannot_write(disk, monkeypatch):
    from dflash_local.errors import StorageError
    from dflash_local.pairs.embedded import embedded_target_dir, import_embedded

    monkeypatch.setenv("DFLASH_LOCAL_HOME", str(read_only(disk)))
    with pytest.raises(StorageError) as refused:
        import_embedded()
    message = str(refused.value)
    assert str(embedded_target_dir().parent) in message, message
    assert "Read-only file system" in message and "DFLASH_LOCAL_HOME" in message, message
    assert list(disk.iterdir()) == []
