"""`dflash-local bench --multi-turn` end to end on a tiny pair: two-turn conversations with the
prefix cache off and on in one run (the same answers; turn 2 reuses turn 1), then the cache's
size under interleaved chats, never above its budget; and the offline two-turn set."""

from __future__ import annotations

import json

from fixtures_tiny import tiny_pair

from dflash_local.bench import datasets
from dflash_local.cli.main import main


def test_multi_turn_reports_both_ways_and_stays_within_budget(tmp_path_factory, home, capsys,
                                                             monkeypatch):
    pair = tiny_pair(tmp_path_factory, "qwen3")
    # the tiny tokenizer has one token a byte: the shipped set's first turns exceed its context
    short = home / "short.jsonl"
    short.write_text("".join(json.dumps({"question_id": i, "category": "reading", "turns": [
        f"Passage {i}: " + "the river bends past the mill and the town. " * 6 + "Summarize it.",
        "Now in one line."]}) + "\n" for i in range(2)))
    monkeypatch.setattr(datasets, "MULTITURN", short)
    out = home / "results"
    assert main(["bench", "--multi-turn", "--engine", "transformers", "--target", str(pair.target),
                 "--drafter", str(pair.drafter), "--max-samples", "2", "--max-tokens", "8",
                 "--block-size", "4", "--conversations", "3", "--prefix-cache-mb", "1",
                 "--out", str(out)]) == 0
    [path] = out.glob("multiturn-*.json")
    record = json.loads(path.read_text())
    samples = record["turns"]["samples"]
    assert len(samples) == 2
    for sample in samples:
        first, second = sample["turns"]
        assert first["identical"] and second["identical"]  # off, on and after a pause
        assert first["off"]["cached_tokens"] == second["off"]["cached_tokens"] == 0
        assert second["on"]["cached_tokens"] >= first["on"]["prompt_tokens"]
        # the pause warmed the reply as turn 2 spells it: all of turn 1, its reply closed
        assert second["pause"]["cached_tokens"] > first["pause"]["prompt_tokens"] + 8
        assert first["pause"]["warm_s"] > 0 == first["on"]["warm_s"]
    bars = record["turns"]["summary"]["bars"]
    assert bars["mode"] == "pause"
    assert bars["cached_over_turn1_prompt_on_min"] >= 1.0
    assert bars["cached_over_turn1_prompt_pause_min"] > 1.0
    memory = record["memory"]
    assert memory["conversations"] == 3 and memory["budget_mib"] == 1.0
    assert memory["within_budget"] and 0 < memory["cache_mib_max"] <= 1.0
    assert memory["entries_end"] == 1  # one chat's entry fits: each new one evicted the last
    assert memory["turn2_reused_own"] == 0  # ...so no second turn found its own first one
    assert memory["warmups_stored"] == 2 * 3  # every reply's next turn, warmed as the service does
    printed = capsys.readouterr().out
    assert "turn 2" in printed and "interleaved chats" in printed and "after a pause" in printed


def test_the_two_turn_set_is_offline_in_mt_benchs_format():
    items = datasets.load_prompts("multiturn", 10)
    assert len(items) == 4 and all(len(item.turns) == 2 for item in items)
    assert all(len(item.turns[0]) > 2500 for item in items)  # a long first turn to reuse
    rows = [json.loads(line) for line in datasets.MULTITURN.read_text().splitlines()]
    assert all(set(row) == {"question_id", "category", "turns"} for row in rows)
