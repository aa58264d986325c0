"""The recorded replies' store on real SQLite: ids kept exactly, the budgets evict the oldest
rows first (by count and by bytes), a pair's rows read back only under its own identity, a file
SQLite cannot read set aside for a fresh one, and `adapt reset|export` on it."""

from __future__ import annotations

import json

import pytest

from dflash_local.adapt.store import RecordedPair, ReplyStore, pair_key
from dflash_local.cli.main import main
from dflash_local.errors import StorageError


def a_pair(name: str) -> RecordedPair:
    identity = {"target": {"path": f"/models/{name}"}, "drafter": None}
    return RecordedPair(pair_key(identity), name, None, identity)


def test_ids_round_trip_and_the_oldest_go_first_by_count(tmp_path):
    store = ReplyStore(tmp_path / "replies.sqlite", max_replies=3)
    pair = a_pair("t")
    for index in range(5):
        store.add(pair, [1, 2**31 + index], [index, 49151], {"temperature": 0.0})
    kept = list(store.replies(pair.identity))
    assert [reply.reply_ids for reply in kept] == [[2, 49151], [3, 49151], [4, 49151]]
    assert kept[0].prompt_ids == [1, 2**31 + 2] and kept[0].meta == {"temperature": 0.0}
    newest = list(store.replies(pair.identity, newest=2))  # what a training round reads
    assert [reply.reply_ids for reply in newest] == [[3, 49151], [4, 49151]]


def test_the_byte_budget_evicts_the_oldest_whichever_pair_wrote_them(tmp_path):
    store = ReplyStore(tmp_path / "replies.sqlite", max_bytes=3 * 40)  # 10 ids of 4 bytes a reply
    first, second = a_pair("first"), a_pair("second")
    store.add(first, list(range(5)), list(range(5)), {})
    for _ in range(3):
        store.add(second, list(range(5)), list(range(5)), {})
    assert [row["pair"] for row in store.summary()] == [second.key]  # first's row and name gone
    assert [pair.key for pair in store.pairs()] == [second.key]
    assert sum(row["bytes"] for row in store.summary()) == 120


def test_another_pairs_replies_are_never_mixed_in(tmp_path):
    store = ReplyStore(tmp_path / "replies.sqlite")
    mine, other = a_pair("mine"), a_pair("other")
    store.add(mine, [1], [2], {})
    store.add(other, [3], [4], {})
    assert [reply.reply_ids for reply in store.replies(mine.identity)] == [[2]]
    assert list(store.replies(a_pair("never recorded").identity)) == []
    # a row whose stored identity is not the one its key was made from is refused, not read
    store.connection.execute("UPDATE pairs SET identity = ? WHERE key = ?",
                             (json.dumps(other.identity), mine.key))
    with pytest.raises(StorageError, match=f"pair {mine.key} was recorded by other models"):
        list(store.replies(mine.identity))


def test_a_corrupt_file_is_set_aside_and_a_fresh_store_started(tmp_path, caplog):
    path = tmp_path / "replies.sqlite"
    store = ReplyStore(path)
    store.add(a_pair("t"), [1], [2], {})
    store.close()
    with path.open("r+b") as damaged:  # the header's magic: SQLite no longer knows the file
        damaged.write(b"not a database at all")
    store = ReplyStore(path)
    assert store.set_aside is not None and store.set_aside.exists()
    assert "set aside" in caplog.text and store.summary() == []
    store.add(a_pair("t"), [1], [2], {})  # and it records again
    assert store.summary()[0]["replies"] == 1


def test_adapt_export_and_reset(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DFLASH_LOCAL_HOME", str(tmp_path / "home"))
    assert main(["adapt", "status"]) == 0  # nothing recorded: said, and nothing created
    assert "no replies recorded" in capsys.readouterr().err
    assert not (tmp_path / "home").exists()
    store = ReplyStore()
    kept, dropped = a_pair("kept"), a_pair("dropped")
    store.add(kept, [1, 2], [3], {"temperature": 0.0})
    store.add(dropped, [4], [5], {})
    assert main(["adapt", "reset", "--pair", "unknown"]) == 2
    assert "--pair 'unknown'" in capsys.readouterr().err
    assert main(["adapt", "reset", "--pair", dropped.key]) == 0
    assert main(["adapt", "export", "--out", str(tmp_path / "out.jsonl")]) == 0
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [(line["pair"], line["prompt_ids"], line["reply_ids"]) for line in lines] == [
        (kept.key, [1, 2], [3])]
    assert main(["adapt", "reset"]) == 0
    assert "1 replies deleted" in capsys.readouterr().out
    assert store.summary() == []  # an open connection (a service's) sees the reset
