"""`dflash-local bench --concurrency` end to end on a tiny pair: a service of its own with
max(N) places, every level's speculative and plain runs beside each other, the replies checked
against each alone, the memory idle, at the peak and drained, and a record naming its machine;
refusals before any model loads."""

from __future__ import annotations

import json

import pytest
from fixtures_tiny import tiny_pair

from dflash_local.bench import concurrency
from dflash_local.cli.main import main

PROMPTS = ["Write a poem.", "Tell me a story."]


def test_levels_measured_with_memory_and_a_named_machine(tmp_path_factory, home, capsys,
                                                         monkeypatch):
    pair = tiny_pair(tmp_path_factory, "qwen3")
    # the tiny tokenizer spells one token a byte: short prompts keep the run in seconds
    monkeypatch.setattr(concurrency, "prompt_texts", lambda count, datasets: PROMPTS[:count])
    path = home / "concurrency.json"
    assert main(["bench", "--engine", "transformers", "--target", str(pair.target),
                 "--drafter", str(pair.drafter), "--concurrency", "1,2", "--max-tokens", "6",
                 "--stagger", "0", "--block-size", "4", "--repeats", "2", "--record", str(path)]) == 0
    record = json.loads(path.read_text())
    assert [row["label"] for row in record["rows"]] == ["1 client", "2 clients"]
    for row in record["rows"]:
        assert row["identical"] == "yes"
        assert row["speculative_aggregate"] > 0 and row["plain_aggregate"] > 0
        assert row["speedup"] == round(row["speculative_aggregate"] / row["plain_aggregate"], 2)
        assert row["speculative_tau"] >= 1 and 1 <= row["speculative_width"] <= 4  # --block-size 4
        assert row["batch_gain"] == round(row["speculative_aggregate"] / row["speculative_one_by_one"], 2)
    memory = record["memory"]
    assert memory["peak_mib"]["rss"] >= memory["idle_mib"]["rss"] > 0
    assert memory["drained_mib"]["rss"] > 0 and memory["drained_trimmed_mib"]["rss"] > 0
    assert record["machine_details"]["cores"] >= 1 and record["machine"]
    assert "--concurrency 1,2" in record["command"] and "--repeats 2" in record["command"]
    assert record["settings"]["repeats"] == 2
    assert "record:" in capsys.readouterr().out


@pytest.mark.parametrize("argv, complaint", [
    (["--concurrency", "0,2"], "client counts >= 1"),
    (["--concurrency", "two"], "client counts >= 1"),
])
def test_bad_levels_refused_by_the_parser(argv, complaint, capsys):
    with pytest.raises(SystemExit):
        main(["bench", *argv])
    assert complaint in capsys.readouterr().err


def test_a_served_engine_refused(capsys):
    assert main(["bench", "--engine", "openai", "--base-url", "http://127.0.0.1:9",
                 "--concurrency", "2"]) != 0
    assert "--concurrency starts a service of its own on a local engine" in capsys.readouterr().err


def test_clients_take_the_named_datasets_prompts_in_turn():
    from dflash_local.bench.datasets import DatasetUnavailableError, load_prompts

    held_out, chat = load_prompts("embedded", 3), load_prompts("chat", 3)
    assert concurrency.prompt_texts(3) == [held_out[0].turns[0], chat[0].turns[0], held_out[1].turns[0]]
    assert concurrency.prompt_texts(2, ("embedded",)) == [p.turns[0] for p in load_prompts("embedded", 2)]
    with pytest.raises(DatasetUnavailableError, match="unknown dataset 'nope'"):
        concurrency.prompt_texts(2, ("nope",))
