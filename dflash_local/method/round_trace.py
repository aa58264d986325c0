"""An opt-in trace of the speculative loop: one JSON line per round, what the planner priced it
at and what each of its steps took, so a round's measured cost can be set against the
calibrated one within one generation (a loaded machine slows every round of a run alike, so a
ratio of rounds in the same run holds where tokens/s across runs does not).

A generation's line comes first ({"generation": label, "prompt_tokens", ...}), then one line per
round: its kind (`mode`), `rows` verified (the anchor included), `kept` drafts, `committed`
tokens, `context` it ran on, the planner's `priced_s` (its calibrated cost at that context,
or as auto re-priced it from the rounds before: planning/observed.py; None under a fixed width) and `expected_tokens`, and the wall seconds of `plan_s`, `propose_s`,
`verify_s`, `accept_s`, `commit_s`, `observe_s` and `emit_s` (the consumer's time between this
round's event and the next round: detokenizing, the stream's own work). `summarize` folds a
trace into per-kind figures relative to the plain steps of the same generation.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from dflash_local.errors import DFlashError

STEPS = ("plan_s", "propose_s", "verify_s", "accept_s", "commit_s", "observe_s", "emit_s")
PLAIN_KINDS = ("plain", "plain-fallback")  # the rounds others are measured against


class RoundTrace:
    """Appends JSON lines to `path`, opened at once (a path that cannot be written fails before
    a model loads, not at its first round); each line written as it comes, so a trace can be
    read while its run goes on."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.label = ""  # the next generation's name (a bench sets "prompt-id method try")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file: IO[str] | None = self.path.open("a", encoding="utf-8", buffering=1)
        except OSError as exc:
            raise DFlashError(f"--trace {self.path}: cannot write there ({exc.strerror or exc})") from exc

    def generation(self, **info) -> None:
        self._write({"generation": self.label, **info})

    def round(self, record: dict) -> None:
        self._write({key: round(value, 6) if isinstance(value, float) else value
                     for key, value in record.items()})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _write(self, record: dict) -> None:
        if self._file is None:  # closed, then written again (a bench's next run): reopened
            self._file = self.path.open("a", encoding="utf-8", buffering=1)  # line-buffered
        self._file.write(json.dumps(record) + "\n")


def read_trace(path: Path | str) -> list[dict]:
    """The generations of a trace file, each {"generation": label, ..., "rounds": [...]}."""
    generations: list[dict] = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        record = json.loads(line)
        if "generation" in record:
            generations.append({**record, "rounds": []})
        elif not generations:
            raise ValueError(f"{path}:{number}: a round before any generation line")
        else:
            generations[-1]["rounds"].append(record)
    return generations


def round_seconds(record: dict) -> float:
    """What the loop spent on the round itself: plan to observe (the consumer's time apart)."""
    return sum(record[step] for step in STEPS if step != "emit_s")


def summarize(generations: Iterable[dict]) -> dict:
    """Per kind of round ("mode xROWS") over every generation: how many, kept drafts and
    committed tokens per round, the median measured and priced seconds of each step, and what
    a loaded machine cannot blur, each measured against the median plain step of the same
    generation (generations without plain steps are left out of these):
    - `measured_vs_plain`, `priced_vs_plain`: the kind's median seconds over that step's (the
      median over generations);
    - `net_plain_steps`: the plain steps the kind's rounds cost beyond the tokens they
      committed, sum(seconds / plain step - committed) over the trace (> 0: lost to plain
      decoding, < 0: won); `generations`: how many generations had the kind."""
    rows: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for generation in generations:
        rounds = generation["rounds"]
        plain = [r for r in rounds if r["mode"] in PLAIN_KINDS]
        plain_s = statistics.median(round_seconds(r) for r in plain) if plain else None
        plain_priced = statistics.median(r["priced_s"] for r in plain) if plain and all(
            r["priced_s"] is not None for r in plain) else None
        by_kind: dict[str, list[dict]] = defaultdict(list)
        for record in rounds:
            by_kind[f"{record['mode']} x{record['rows']}"].append(record)
        for kind, records in by_kind.items():
            figures = rows[kind]
            figures["generations"].append(1)
            for record in records:
                figures["kept"].append(record["kept"])
                figures["committed"].append(record["committed"])
                figures["seconds"].append(round_seconds(record))
                for step in STEPS:
                    figures[step].append(record[step])
                if record["priced_s"] is not None:
                    figures["priced_s"].append(record["priced_s"])
            if plain_s:
                figures["measured_vs_plain"].append(
                    statistics.median(round_seconds(r) for r in records) / plain_s)
                figures["net"].append(sum(round_seconds(r) / plain_s - r["committed"]
                                          for r in records))
            priced = [r["priced_s"] for r in records if r["priced_s"] is not None]
            if plain_priced and priced:
                figures["priced_vs_plain"].append(statistics.median(priced) / plain_priced)
    return {kind: _fold(figures) for kind, figures in sorted(rows.items())}


def format_summary(summary: dict) -> str:
    """The summary as a table: one row per kind of round."""
    header = (f"{'round kind':<20} {'rounds':>6} {'gens':>4} {'kept':>5} {'tokens':>6} {'ms':>7} "
              f"{'vs plain':>8} {'priced':>6} {'net steps':>9}")
    lines = [header]
    for kind, figures in summary.items():
        ratios = [_cell(figures.get(name), spec) for name, spec in (
            ("measured_vs_plain", ".3f"), ("priced_vs_plain", ".3f"), ("net_plain_steps", "+.1f"))]
        lines.append(f"{kind:<20} {figures['rounds']:>6} {figures['generations']:>4} "
                     f"{figures['kept_per_round']:>5.2f} {figures['committed_per_round']:>6.2f} "
                     f"{figures['median_seconds'] * 1000:>7.1f} {ratios[0]:>8} {ratios[1]:>6} "
                     f"{ratios[2]:>9}")
    return "\n".join(lines)


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _fold(figures: dict[str, list[float]]) -> dict:
    folded = {"rounds": len(figures["seconds"]), "generations": len(figures["generations"]),
              "kept_per_round": statistics.fmean(figures["kept"]),
              "committed_per_round": statistics.fmean(figures["committed"])}
    for name in ("seconds", "priced_s", *STEPS):
        if figures.get(name):
            folded[f"median_{name}"] = statistics.median(figures[name])
    for name in ("measured_vs_plain", "priced_vs_plain"):
        if figures.get(name):
            folded[name] = statistics.median(figures[name])
            folded[f"{name}_generations"] = len(figures[name])
    if figures.get("net"):
        folded["net_plain_steps"] = sum(figures["net"])
    return {key: round(value, 6) if isinstance(value, float) else value
            for key, value in folded.items()}
