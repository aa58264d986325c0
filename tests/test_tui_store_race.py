"""Two dflash-chat instances starting together on a new data dir (issue 52, item 8): two real
processes open the same fresh chat history at once, round after round; every open succeeds and
the schema comes out whole."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from dflash_chat.storage import ChatStore

ROUNDS = 40
RACERS = 2


def open_fresh_stores(folder: str, barrier, errors) -> None:
    """Each round, wait for the other racer, then open that round's new store."""
    for round_index in range(ROUNDS):
        barrier.wait(timeout=60)
        try:
            ChatStore(Path(folder) / f"round-{round_index}.sqlite3").close()
        except Exception as exc:  # noqa: BLE001 - whatever the race does is reported
            errors.put(f"round {round_index}: {type(exc).__name__}: {exc}")


def test_two_processes_opening_a_new_store_at_once_both_succeed(tmp_path):
    spawn = multiprocessing.get_context("spawn")
    barrier, errors = spawn.Barrier(RACERS), spawn.Queue()
    racers = [spawn.Process(target=open_fresh_stores, args=(str(tmp_path), barrier, errors))
              for _ in range(RACERS)]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join(timeout=120)
        if racer.is_alive():  # stuck: ended here, and the exit code below says so
            racer.kill()
    assert [racer.exitcode for racer in racers] == [0] * RACERS
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert failures == []
    store = ChatStore(tmp_path / f"round-{ROUNDS - 1}.sqlite3")
    chat = store.create_chat("after the race")
    store.add_message(chat.id, "user", "searchable words")
    assert [hit.chat.id for hit in store.search("searchable")] == [chat.id]
