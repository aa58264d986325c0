"""scripts/ab_commits.py's record: each run a row of a docs/records/ record the benchmarks page
renders, keyed by engine, set and drafter, with the machine the run described."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def a_run(engine: str, old: float, new: float, drafter: str = "old", block_size: str = "auto") -> dict:
    from dflash_local.bench.machine import describe

    return {"compares": "A against B", "machine": {**describe(), "load_average_during": [1.0, 2.5]},
            "command": f"scripts/ab_commits.py A B --engine {engine} --drafter {drafter} "
                       f"--block-size {block_size}", "date": "2026-12-07",
            "engine": engine, "dataset": "embedded", "drafter": drafter, "block_size": block_size,
            "samples": 4, "max_tokens": 128, "identical": 4 if drafter != "own" else None,
            "tokens_per_s": {"old": old, "new": new}, "mean_tau": {"old": 2.5, "new": 2.5},
            "new_over_old": new / old, "new_over_old_95": [0.9, 1.2]}


def test_runs_become_rows_of_a_record_the_page_renders(tmp_path):
    ab, renderer = load_script("ab_commits"), load_script("render_benchmarks")
    path = tmp_path / "ab-a-b.json"
    ab.add_to_record(path, a_run("mlx", 10.0, 9.0))
    ab.add_to_record(path, a_run("transformers", 20.0, 21.0, drafter="own"))
    ab.add_to_record(path, a_run("transformers", 20.0, 20.0, block_size="1"))
    record = ab.add_to_record(path, a_run("mlx", 10.0, 10.5))  # the same row, measured again
    assert json.loads(path.read_text()) == record
    assert not [field for field in renderer.REQUIRED if field not in record]
    rows = {row["label"]: row for row in record["rows"]}
    assert set(rows) == {"MLX, embedded, the older checkout's drafter",
                         "Transformers, embedded, each its own drafter",
                         "Transformers, embedded, plain decoding"}
    assert rows["MLX, embedded, the older checkout's drafter"]["ratio"] == 1.05
    assert rows["Transformers, embedded, each its own drafter"]["identical"] == "not compared"
    assert rows["Transformers, embedded, plain decoding"]["load"] == "1.0-2.5"
    assert record["engine"] == "MLX, Transformers" and len(record["command"]) == 3
    assert record["machine_details"]["cpu_model"] in record["machine"]
    table = renderer.table(record)
    assert "| MLX, embedded, the older checkout's drafter | 10.0 | 10.5 | 1.050 | 0.900-1.200 |" in table


def test_the_interval_holds_the_ratio_and_is_a_point_when_every_prompt_agrees():
    ab = load_script("ab_commits")

    def prompt(old_s: float, new_s: float) -> dict:
        return {"old": {"tokens": 100, "decode_s": old_s}, "new": {"tokens": 100, "decode_s": new_s}}

    assert ab.ratio_interval([prompt(2.0, 1.0)] * 5) == [2.0, 2.0]
    swinging = [prompt(2.0, 1.0), prompt(1.0, 2.0), prompt(1.0, 1.1), prompt(1.5, 1.4)] * 3
    low, high = ab.ratio_interval(swinging)
    total = sum(p["old"]["decode_s"] for p in swinging) / sum(p["new"]["decode_s"] for p in swinging)
    assert low < total < high and high - low > 0.2


def test_rounds_are_told_apart_by_mode_width_and_tree():
    """A tree drafts more than its longest path holds; the kept drafts are a mean per kind."""
    ab = load_script("ab_commits")
    fields = ab.ROUND_FIELDS
    rounds = [dict(zip(fields, ("speculative", 8, 12, 7, 3, 0))), dict(zip(fields, ("speculative", 8, 7, 7, 5, 0))),
              dict(zip(fields, ("speculative", 8, 7, 7, 2, 0))), dict(zip(fields, ("plain", 1, 0, 0, 0, 0)))]
    lines = [{"prompt": "a", "rounds": [[r[name] for name in fields] for r in rounds[:2]]},
             {"prompt": "b", "rounds": [[r[name] for name in fields] for r in rounds[2:]]}]
    assert ab.round_kinds(lines) == {"plain x1": {"rounds": 1, "kept": 0.0},
                                     "speculative x8": {"rounds": 2, "kept": 3.5},
                                     "speculative x8 tree": {"rounds": 1, "kept": 3.0}}
