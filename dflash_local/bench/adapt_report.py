"""`bench --adapt-stream`'s command and record: the measured kinds (adapt_stream.py) as a record
scripts/render_benchmarks.py renders (title, columns, rows, notes), with every figure also kept
raw under `results`. Gains are against the same kind's 0-reply checkpoint: the shipped drafter
on the same service, prompts and machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import UTC, datetime
from pathlib import Path

COLUMNS = (("tau", "τ held out", 2), ("tau_gain", "τ / shipped", 2),
           ("speedup", "speedup", 2), ("speedup_gain", "speedup / shipped", 2),
           ("general_tau", "τ general held out", 2), ("general_gain", "general / shipped", 2),
           ("identical", "same as plain", 0), ("version", "drafter", 0),
           ("caught_up_s", "catch-up (s)", 1))
ABSENT = ("Adaptation absent: this service records replies but does not train, so every "
          "checkpoint measures the shipped drafter (its figures differ only by noise).")


def rows_of(result: dict) -> list[dict]:
    """One row per checkpoint of a kind; gains over its first measured checkpoint."""
    measured = [p for p in result["points"] if "tau" in p]
    base = measured[0] if measured else {}
    rows = []
    for point in result["points"]:
        label = f"{result['kind']}, {point['replies']} replies"
        if "tau" not in point:
            rows.append({"label": label, "tau": f"not reached: {point['missing']}"})
            continue
        row = {"label": label, "tau": point["tau"], "tau_gain": point["tau"] / base["tau"],
               "identical": "yes" if point["identical"] else "NO",
               "version": ", ".join("shipped" if v is None else f"v{v}"
                                    for v in point["versions"]),
               "caught_up_s": point.get("caught_up_s")}
        if base.get("speedup"):
            row |= {"speedup": point["speedup"], "speedup_gain": point["speedup"] / base["speedup"]}
        if "general_tau" in point:
            row |= {"general_tau": point["general_tau"],
                    "general_gain": point["general_tau"] / base["general_tau"]}
        rows.append(row)
    return rows


def ttft_note(result: dict) -> str:
    during, idle = result["ttft"]["during_training"], result["ttft"]["idle"]
    idle_words = _times(idle)
    if not during:
        return (f"{result['kind']}: no probe arrived during training (idle time to first token "
                f"{idle_words})")
    gap = statistics.fmean(during) - statistics.fmean(idle)
    return (f"{result['kind']}: time to first token of a request arriving during training "
            f"{_times(during)}, idle {idle_words}: {gap * 1000:+.0f} ms")


def _times(seconds: list[float]) -> str:
    if not seconds:
        return "not measured"
    ordered = sorted(seconds)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return f"mean {statistics.fmean(ordered):.3f} s, p95 {p95:.3f} s ({len(ordered)} arrivals)"


def adapt_record(results: list[dict], meta: dict) -> dict:
    """The record: `meta` has command, machine, engine, pair, and the run's settings."""
    notes = [] if all(r["adaptation"] for r in results) else [ABSENT]
    notes += [ttft_note(result) for result in results]
    notes += [f"{r['kind']}: {r['source']}; {r['stream']} stream and {r['held_out']} held-out "
              f"prompts" for r in results]
    return {
        "title": "The drafter learning a user's traffic: held-out τ and speedup as replies "
                 "accumulate",
        "measured": "Per kind of use, a fresh service serves the kind's stream of prompts (each "
                    "reply recorded); at each checkpoint, once adaptation has caught up, the "
                    "kind's held-out prompts are served plain and speculative (greedy, "
                    "interleaved, never recorded) and the general held-out set speculative "
                    "(forgetting); gains are against the kind's 0-reply checkpoint (the shipped "
                    "drafter).",
        "command": meta["command"], "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": meta["machine"], "engine": meta["engine"],
        "dataset": ", ".join(r["kind"] for r in results), "settings": meta["settings"],
        "row_header": "kind, replies served",
        "columns": [{"key": key, "label": label, "decimals": decimals}
                    for key, label, decimals in COLUMNS],
        "rows": [row for result in results for row in rows_of(result)],
        "source": "dflash_local/bench/adapt_stream.py",
        "compares": "held-out τ and speedup after 0-200 replies of one kind of use, the general "
                    "held-out τ (forgetting), and time to first token during training vs idle",
        "notes": notes, "results": results}


def format_rows(record: dict) -> str:
    keys = [key for key, _, _ in COLUMNS]
    lines = ["  ".join([f"{record['row_header']:<28}", *(f"{k:>13}" for k in keys)])]
    for row in record["rows"]:
        cells = [_cell(row.get(key)) for key in keys]
        lines.append("  ".join([f"{row['label']:<28}", *(f"{c:>13}" for c in cells)]))
    return "\n".join(lines + record["notes"])


def _cell(value) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def run(args: argparse.Namespace) -> int:
    """`bench --adapt-stream`: load the kinds (refusals before any service starts), measure,
    write the record."""
    from dflash_local.bench.adapt_kinds import load_kinds
    from dflash_local.bench.adapt_stream import StreamSettings, run_kinds

    kinds = tuple(k.strip() for k in args.adapt_stream.split(",") if k.strip())
    settings = StreamSettings(checkpoints=args.adapt_checkpoints, max_tokens=args.max_tokens,
                              ttft_arrivals=args.ttft_arrivals, serve_args=serve_args(args))
    sets = load_kinds(kinds, max(settings.checkpoints), args.held_out, args.sharegpt_file)
    results = run_kinds(sets, kinds, settings, args.out / "adapt-stream-homes")
    path = write_record(results, args)
    print(format_rows(json.loads(path.read_text(encoding="utf-8"))))
    print(f"record: {path}")
    return 0


def write_record(results: list[dict], args: argparse.Namespace) -> Path:
    from dflash_local.method.calibration import machine_info

    machine = machine_info()
    pair = getattr(args, "pair", None) or args.target or "embedded"
    record = adapt_record(results, {
        "command": "dflash-local bench " + " ".join(sys.argv[2:]),
        "machine": f"{machine['cpu_model']}, {machine['cores']} cores",
        "engine": args.engine, "settings": {
            "pair": pair, "max_tokens": args.max_tokens, "held_out": args.held_out,
            "checkpoints": ", ".join(map(str, args.adapt_checkpoints)),
            "ttft_arrivals": args.ttft_arrivals, "prefix_cache": "off", "temperature": 0}})
    path = args.record or args.out / "adapt-stream.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def serve_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The engine and pair flags `bench` was given, as `serve` takes them."""
    chosen = ["--engine", args.engine] if args.engine not in (None, "auto") else []
    for flag in ("pair", "target", "drafter", "dtype"):
        value = getattr(args, flag, None)
        if value not in (None, "auto"):
            chosen += [f"--{flag}", str(value)]
    return tuple(chosen)


def checkpoints(text: str) -> tuple[int, ...]:
    """--adapt-checkpoints "0,25,50": increasing counts of replies, from 0."""
    try:
        counts = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers")\
            from None
    if not counts or counts[0] < 0 or list(counts) != sorted(set(counts)):
        raise argparse.ArgumentTypeError(f"{text!r}: counts must be >= 0 and increasing")
    return counts
