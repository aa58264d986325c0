"""The opt-in round trace (round_trace.py): the real loop on a tiny Transformers pair writes one
line per round that agrees with its events and with what the planner priced, and the summary
measures each kind of round against the plain steps of the same generation."""

from __future__ import annotations

import json

import pytest
from fixtures_tiny import collect, tiny_engine, tiny_pair

from dflash_local.events import GenerationParams, parse_block_size
from dflash_local.method.planning.costs import RoundCosts
from dflash_local.method.planning.modes import LOOKUP, PLAIN
from dflash_local.method.round_trace import STEPS, RoundTrace, read_trace, round_seconds, summarize

COSTS = RoundCosts(tuple(1.0 + 0.05 * (w - 1) + (0.5 if w > 1 else 0.0) for w in range(1, 17)),
                   tuple(1.0 + 0.05 * (w - 1) for w in range(1, 17)))


@pytest.fixture
def engine(tmp_path_factory):
    engine = tiny_engine(tiny_pair(tmp_path_factory, "llama"))
    yield engine
    engine.round_trace = None


def test_the_loop_writes_a_line_per_round_as_its_events_and_prices_say(engine, tmp_path, monkeypatch):
    from dflash_local.method.calibration import Calibration

    monkeypatch.setattr(engine, "calibration", Calibration(COSTS, (0.1,) * 15, {}, "", 0.0))
    engine.round_trace = trace = RoundTrace(tmp_path / "trace.jsonl")
    prompt_ids = engine.encode_chat([{"role": "user", "content": "the cat and the cat and the"}])
    runs = {}
    for label, params in (("plain", GenerationParams(max_tokens=24, speculative=False, stop_token_ids=(-1,))),
                          ("auto", GenerationParams(max_tokens=24, block_size=parse_block_size("auto"),
                                                    stop_token_ids=(-1,)))):
        trace.label = label
        runs[label] = collect(engine.stream(prompt_ids, params))[1]
    trace.close()
    generations = read_trace(tmp_path / "trace.jsonl")
    assert [g["generation"] for g in generations] == ["plain", "auto"]
    for generation in generations:
        events = runs[generation["generation"]][1:]
        assert generation["prompt_tokens"] == len(prompt_ids)
        assert len(generation["rounds"]) == len(events)
        for record, event in zip(generation["rounds"], events):
            assert (record["mode"], record["rows"], record["committed"]) == (
                event.mode, event.width, len(event.token_ids))
            assert record["kept"] >= event.accepted and all(record[step] >= 0 for step in STEPS)
    plain, auto = (g["rounds"] for g in generations)
    assert {r["mode"] for r in plain} == {PLAIN} and all(r["priced_s"] is None for r in plain)
    context = len(prompt_ids) + 1
    for record in auto:  # priced as the calibration says, at the round's own context
        assert record["context"] == context
        context += record["committed"]
        verify = COSTS.verify_only[record["rows"] - 1]
        drafter_pass = record["mode"] != LOOKUP and record["rows"] > 1
        assert record["priced_s"] == pytest.approx(verify + (0.5 if drafter_pass else 0.0), abs=1e-6)
    lookups = [r for r in auto if r["mode"] == LOOKUP]
    assert lookups, "the repeated prompt should have made the planner copy at least once"
    assert all(r["expected_tokens"] > 1.0 for r in lookups)


def _round(mode: str, rows: int, committed: int, verify_s: float, priced_s: float | None = None) -> dict:
    return {"mode": mode, "rows": rows, "kept": committed - 1, "committed": committed, "context": 10,
            "priced_s": priced_s, "expected_tokens": None, **dict.fromkeys(STEPS, 0.0),
            "verify_s": verify_s}


def test_the_summary_measures_each_kind_against_the_same_generations_plain_steps(tmp_path):
    # a generation on a machine twice as slow as the other: the ratios must not see it
    fast = [_round("plain-fallback", 1, 1, s, 1.0) for s in (0.10, 0.10, 0.12)]
    fast += [_round("lookup", 2, 1, 0.12, 1.1), _round("lookup", 2, 2, 0.12, 1.1)]
    slow = [_round("plain-fallback", 1, 1, 0.20, 1.0), _round("lookup", 2, 1, 0.24, 1.1)]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in (
        {"generation": "fast"}, *fast, {"generation": "slow"}, *slow)))
    generations = read_trace(path)
    assert round_seconds(generations[0]["rounds"][0]) == pytest.approx(0.10)
    summary = summarize(generations)
    lookup = summary["lookup x2"]
    assert (lookup["rounds"], lookup["generations"]) == (3, 2)
    assert lookup["measured_vs_plain"] == pytest.approx(1.2)
    assert lookup["priced_vs_plain"] == pytest.approx(1.1)
    # fast: 1.2 - 1 + 1.2 - 2; slow: 1.2 - 1 (each against its own median plain step)
    assert lookup["net_plain_steps"] == pytest.approx(-0.4)
    assert summary["plain-fallback x1"]["net_plain_steps"] == pytest.approx(0.2)
    assert lookup["committed_per_round"] == pytest.approx(4 / 3)


def test_a_trace_that_starts_with_a_round_is_refused_with_its_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(_round("plain", 1, 1, 0.1)) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: a round before any generation line"):
        read_trace(path)


def test_the_trace_command_prints_the_summary_of_the_matching_generations(tmp_path, capsys):
    from dflash_local.cli.main import main

    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in (
        {"generation": "chat/8 | plain"}, _round("plain", 1, 1, 0.1),
        {"generation": "chat/8 | dflash auto"}, _round("plain-fallback", 1, 1, 0.1, 1.0),
        _round("lookup", 2, 1, 0.12, 1.1))))
    assert main(["trace", str(path), "--match", "auto"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "1 generations" and len(table) == 4  # the header and two kinds
    assert table[2].split()[:2] == ["lookup", "x2"] and table[2].split()[-3:] == ["1.200", "1.100", "+0.2"]
    assert main(["trace", str(path), "--match", "no such run"]) == 2
    assert "no generation's label holds 'no such run'" in capsys.readouterr().err
    assert main(["trace", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl: no such file" in capsys.readouterr().err
