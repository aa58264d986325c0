"""dflash-chat on a chat history it cannot use as it is (issue 52, item 7), with the real faults:
a truncated and a garbage file, a file on a read-only bind mount, and a full file system (a
small tmpfs). The app starts, says what happened, keeps a damaged file beside the new one, and
keeps a prompt the disk refused in the input. The mounts need root; elsewhere those cases skip."""

from __future__ import annotations

import errno
import subprocess
import tempfile
from pathlib import Path

import pytest
from dflash_chat.storage import DB_NAME, ChatStore
from dflash_chat.widgets.prompt_input import PromptInput
from tui_support import run_offline, until

WIDE = (150, 45)
PROMPT = "Summarise the notes I pasted yesterday."


def said(app) -> str:
    return "\n".join(str(note.message) for note in app._notifications)


def write_history(data_dir: Path, chats: int = 30) -> Path:
    """A history with enough pages that cutting the file in half breaks its tables."""
    store = ChatStore(data_dir / DB_NAME)
    for index in range(chats):
        chat = store.create_chat(f"chat {index}")
        for _ in range(8):
            store.add_message(chat.id, "user", "words to search for later " * 40)
    store.close()
    return data_dir / DB_NAME


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


def overwrite_header(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(b"not a database, whatever it was" + data[31:])


def mount(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *args], check=False, capture_output=True, text=True)


@pytest.fixture
def small_disk(tmp_path, monkeypatch):
    """A 1 MiB tmpfs as the data dir, unmounted after the test."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = mount("-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk))
    if mounted.returncode != 0:
        pytest.skip(f"no tmpfs here: {mounted.stderr.strip()}")
    monkeypatch.setenv("DFLASH_LOCAL_HOME", str(disk))
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


def read_only_bind(path: Path) -> None:
    """Mount the file over itself, read-only."""
    bound = mount("--bind", str(path), str(path))
    if bound.returncode != 0:
        pytest.skip(f"no bind mount here: {bound.stderr.strip()}")
    subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True)


def fill(disk: Path) -> Path:
    """Write a file until the file system says it is full."""
    filler = disk / "filler"
    with filler.open("wb") as out:
        try:
            while True:
                out.write(b"\0" * 65536)
                out.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return filler


@pytest.mark.parametrize("damage", [truncate, overwrite_header], ids=["truncated", "garbage"])
def test_a_damaged_history_is_set_aside_and_a_new_one_starts(tmp_path, monkeypatch, damage):
    monkeypatch.setenv("DFLASH_LOCAL_HOME", str(tmp_path))
    path = write_history(tmp_path)
    damage(path)
    damaged_bytes = path.read_bytes()

    async def scenario(app, pilot):
        assert "damaged" in said(app), said(app)
        copies = list(tmp_path.glob(f"{DB_NAME}.damaged-*"))
        assert [copy.name for copy in copies if copy.name in said(app)] == [copies[0].name]
        assert copies[0].read_bytes() == damaged_bytes  # what the user had, untouched
        assert app.store.path == path and app.store.chats() == []
        app.chat_screen.query_one(PromptInput).value = PROMPT
        await pilot.press("enter")
        await until(pilot, lambda: app.chat_screen.conversation.generating, "prompt sent")

    run_offline(scenario, WIDE)
    assert [m.content for m in ChatStore(path).messages(1)] == [PROMPT, ""]


def test_a_read_only_history_is_left_alone_and_chats_stay_in_memory(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_LOCAL_HOME", str(tmp_path))
    path = write_history(tmp_path, chats=2)
    before = path.read_bytes()
    read_only_bind(path)  # as root chmod stops nobody: the file system refuses the writes

    async def scenario(app, pilot):
        assert "cannot be written" in said(app) and "in memory" in said(app), said(app)
        app.chat_screen.query_one(PromptInput).value = PROMPT
        await pilot.press("enter")
        await until(pilot, lambda: app.chat_screen.conversation.generating, "prompt sent")
        assert [c.title for c in app.store.chats()] == [PROMPT]

    try:
        run_offline(scenario, WIDE)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)  # -l: even while open
    assert path.read_bytes() == before


def test_a_full_disk_at_start_keeps_chats_in_memory(small_disk):
    fill(small_disk)

    async def scenario(app, pilot):
        assert "full" in said(app) and "in memory" in said(app), said(app)
        assert str(app.store.path) == ":memory:"

    run_offline(scenario, WIDE)


def test_a_prompt_the_full_disk_refuses_stays_in_the_input(small_disk):
    async def scenario(app, pilot):
        screen = app.chat_screen
        prompt = screen.query_one(PromptInput)
        filler = fill(small_disk)
        prompt.value = PROMPT * 200  # more than the WAL's free room: the write needs new pages
        await pilot.press("enter")
        await until(pilot, lambda: "Your prompt is kept" in said(app), "the refusal said")
        assert prompt.value == PROMPT * 200
        assert not screen.conversation.generating and screen.conversation.views() == []
        filler.unlink()  # room again: the same prompt goes
        await pilot.press("enter")
        await until(pilot, lambda: screen.conversation.generating, "prompt sent")
        assert prompt.value == ""

    run_offline(scenario, WIDE)


def test_keys_that_write_on_a_full_disk_say_so_and_the_app_goes_on(small_disk):
    async def scenario(app, pilot):
        screen = app.chat_screen
        screen.query_one(PromptInput).value = PROMPT
        await pilot.press("enter")
        await until(pilot, lambda: screen.conversation.generating, "prompt sent")
        await pilot.press("escape")  # stopped: the partial reply is kept
        await until(pilot, lambda: not screen.conversation.generating, "reply stopped")
        fill(small_disk)
        for _ in range(40):  # each toggle is one small write: the WAL's slack runs out
            await pilot.press("f2")
            if "could not be written" in said(app):
                break
        assert "could not be written" in said(app), said(app)
        await pilot.press("ctrl+n")  # still answering keys
        assert screen.conversation.chat_id is None

    run_offline(scenario, WIDE)


@pytest.fixture
def read_only_disk(small_disk):
    """small_disk remounted read-only: not even the data folder can be made."""
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    return small_disk


def test_a_read_only_data_folder_starts_with_chats_in_memory(read_only_disk, monkeypatch):
    monkeypatch.setenv("DFLASH_LOCAL_HOME", str(read_only_disk / "home"))

    async def scenario(app, pilot):
        assert "cannot be written" in said(app) and "in memory" in said(app), said(app)
        app.chat_screen.query_one(PromptInput).value = PROMPT
        await pilot.press("enter")
        await until(pilot, lambda: app.chat_screen.conversation.generating, "prompt sent")
        assert [c.title for c in app.store.chats()] == [PROMPT]

    run_offline(scenario, WIDE)


def test_the_service_log_goes_elsewhere_when_the_data_folder_is_read_only(read_only_disk):
    from dflash_chat.service import fresh_log

    log = fresh_log(read_only_disk / "home" / "logs" / "service.log")
    assert log.parent == Path(tempfile.gettempdir()) and log.read_bytes() == b""
    log.unlink()
