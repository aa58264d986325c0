"""What adapting while idle buys, and what it costs a request: the embedded pair serves a stream
of prompts of one kind (the drafter adapting between them, as the worker runs its slices when
idle), then held-out prompts of the same kind and of the general kind (forgetting). Not run in
CI (minutes of decoding and training); the Transformers engine.

    nice .venv/bin/python scripts/adapt_idle_measure.py --record docs/records/adapt-idle-embedded.json
    .venv/bin/python scripts/render_benchmarks.py

Rows: teacher-forced τ (the drafts greedy verification would accept, on every 4th block of the
target's own greedy replies) of the shipped drafter, the one serving after the stream and the
candidate still in training, on
the held-out replies of the stream's kind and on the general held-out set; τ as decoded (the
held-out prompts decoded again by the serving drafter); and each kind of slice's length (p50,
p90, max): the longest a request arriving during adaptation waits before its first round.

--kind takes a bench dataset (humaneval, embedded, ...) or a kind of `bench --adapt-stream`
(coding, general, language, agent: bench/adapt_kinds.py; ShareGPT's reserved bucket left out).
--policy restart-on-dip runs the rounds as they ran before adapt/idle.py's `verdict`: a candidate
whose held-out mean fell below the serving drafter's at all started again from it (a before/after
of that one decision, the rest the same code).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def decoded(engine, messages: list[dict], max_tokens: int) -> tuple[list[int], list[int], dict]:
    """(prompt ids, reply ids, {tau, tok_s}) of one greedy speculative reply."""
    from dflash_local.events import GenerationParams, GenerationStats

    prompt_ids = engine.encode_chat(messages)
    stats, reply = GenerationStats(), []
    for event in engine.stream(prompt_ids, GenerationParams(max_tokens=max_tokens)):
        stats.add(event)
        reply += event.token_ids
    return prompt_ids, reply, {"tau": stats.tau, "tok_s": stats.decode_tokens_per_s}


def prompt_sets(kind: str, stream: int, held_out: int) -> tuple[list, list, list]:
    """(stream, held-out, general held-out) as chat messages: an adapt-stream kind's sets and
    ShareGPT's general ones, or a bench dataset's first prompts and the embedded set."""
    from dflash_local.bench.adapt_kinds import load_kinds
    from dflash_local.bench.datasets import load_prompts

    if kind in idle_kinds():
        sets = load_kinds((kind,), stream, held_out)
        return ([list(p.as_text().messages) for p in sets[kind].stream],
                [list(p.as_text().messages) for p in sets[kind].held_out],
                [list(p.as_text().messages) for p in sets["general"].held_out])
    as_messages = lambda prompts: [[{"role": "user", "content": p.turns[0]}] for p in prompts]
    prompts = as_messages(load_prompts(kind, stream + held_out))
    return prompts[:stream], prompts[stream:], as_messages(load_prompts("embedded", held_out))


def idle_kinds() -> tuple[str, ...]:
    from dflash_local.bench.adapt_kinds import KINDS

    return KINDS


def restart_on_dip(candidate: list[int], serving: list[int]) -> str:
    """The decision before `verdict`: any dip in the held-out mean restarted the candidate."""
    from dflash_local.adapt import idle

    if idle.better_by_margin(candidate, serving):
        return idle.PUBLISH
    return idle.RESTART if statistics.fmean(candidate or [0]) < statistics.fmean(serving or [0]) else idle.TRAIN_ON


def slice_rows(timings) -> list[dict]:
    kinds: dict[str, list[float]] = {}
    for kind, seconds in timings:
        kinds.setdefault(kind, []).append(seconds)
    rows = []
    for kind, seconds in sorted(kinds.items()):
        ordered = sorted(seconds)
        rows.append({"label": f"slices: {kind}", "count": len(ordered),
                     "p50_s": round(ordered[len(ordered) // 2], 3),
                     "p90_s": round(ordered[int(len(ordered) * 0.9)], 3), "max_s": round(ordered[-1], 3)})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", default="humaneval", help="bench/datasets.py's set the stream and "
                                                             "its held-out prompts come from")
    parser.add_argument("--stream", type=int, default=24, help="replies served while adapting")
    parser.add_argument("--held-out", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--policy", choices=["verdict", "restart-on-dip"], default="verdict")
    parser.add_argument("--record", type=Path, help="the JSON record this run's rows go into")
    args = parser.parse_args()
    from dflash_local.adapt import idle
    from dflash_local.adapt.idle import build_adaptation
    from dflash_local.adapt.record import ReplyRecorder, recorded_pair
    from dflash_local.adapt.store import ReplyStore
    from dflash_local.bench.adapt_forced import every_fourth_block, forced_tau, tapped_replies
    from dflash_local.engines.torch_engine import TorchEngine
    from dflash_local.pairs.default_pair import EMBEDDED_DRAFTER_DIR, embedded_target
    from dflash_local.paths import shipped_models_dir

    target = embedded_target()
    os.environ["DFLASH_LOCAL_HOME"] = tempfile.mkdtemp(prefix="adapt-measure-")  # not the user's store
    engine = TorchEngine(target, shipped_models_dir() / EMBEDDED_DRAFTER_DIR)
    if args.policy == "restart-on-dip":
        idle.verdict = restart_on_dip
    stream, held, general = prompt_sets(args.kind, args.stream, args.held_out)
    recorder = ReplyRecorder(recorded_pair(engine.pair, ("embedded", "smollm2-135m-dflash")))
    adaptation = build_adaptation(engine, recorder)
    before = {name: [decoded(engine, p, args.max_tokens) for p in items]
              for name, items in (("kind", held), ("general", general))}
    store, started, rounds = ReplyStore(), time.perf_counter(), []
    for prompt in stream:  # served, recorded, then the worker's idle slices until caught up
        prompt_ids, reply_ids, _ = decoded(engine, prompt, args.max_tokens)
        store.add(recorder.pair, prompt_ids, reply_ids, {})
        while adaptation.has_work():
            adaptation.run_slice()
        if adaptation.last_round and (not rounds or rounds[-1]["round"] != adaptation.last_round["round"]):
            rounds.append(dict(adaptation.last_round, replies=store.count(recorder.pair.key)))
            print(json.dumps(rounds[-1]), flush=True)
    stream_s = time.perf_counter() - started
    after = {name: [decoded(engine, p, args.max_tokens) for p in items]
             for name, items in (("kind", held), ("general", general))}
    trainer = adaptation.trainer
    rows = []
    general_source = "ShareGPT" if args.kind in idle_kinds() else "embedded"
    for name, label in (("kind", f"held-out {args.kind}"), ("general", f"held-out general ({general_source})")):
        sequences = tapped_replies(adaptation.teacher, trainer.settings,
                                   [(prompt_ids, reply_ids) for prompt_ids, reply_ids, _ in before[name]])
        rows.append({"label": label,
                     "forced_tau_shipped": round(forced_tau(trainer, trainer.shipped, sequences, every_fourth_block), 3),
                     "forced_tau_serving": round(forced_tau(trainer, trainer.serving, sequences, every_fourth_block), 3),
                     "forced_tau_candidate": round(forced_tau(trainer, None, sequences, every_fourth_block), 3),
                     "tau_shipped": round(statistics.fmean(r[2]["tau"] for r in before[name]), 3),
                     "tau_serving": round(statistics.fmean(r[2]["tau"] for r in after[name]), 3)})
        assert [r[1] for r in before[name]] == [r[1] for r in after[name]], "adapted output differs"
    rows += slice_rows(adaptation.sizer.timings)
    verdicts = [r["verdict"] for r in rounds]
    summary = {"version": engine.drafter_version, "history": adaptation.status()["history"],
               "rounds": adaptation.rounds, "policy": args.policy,
               "verdicts": {v: verdicts.count(v) for v in sorted(set(verdicts))},
               "stream_s": round(stream_s, 1)}
    print(json.dumps({"rows": rows, **summary}, indent=1))
    if args.record:
        write_measure_record(args, rows, summary)
    return 0


def write_measure_record(args, rows: list[dict], summary: dict) -> None:
    from dflash_local.bench.report import write_record

    command = "nice .venv/bin/python scripts/adapt_idle_measure.py " + " ".join(sys.argv[1:])
    record = {
        "title": "Adapting the drafter while idle: held-out τ and slice lengths",
        "measured": __doc__.split("\n\n")[2].replace("\n", " "),
        "command": command, "date": datetime.date.today().isoformat(),
        "engine": "Transformers", "dataset": f"{args.kind} (stream and held-out) and a general held-out set",
        "settings": {"pair": "embedded (SmolLM2-135M-Instruct + smollm2-135m-dflash)",
                     "stream": args.stream, "held_out": args.held_out, "max_tokens": args.max_tokens,
                     "rounds": "adapt/idle.py RoundSettings defaults", **summary},
        "row_header": "set", "source": "scripts/adapt_idle_measure.py",
        "compares": "the shipped drafter against the one adaptation serves after a stream of one "
                    "kind of prompt, and how long each kind of idle slice runs",
        "columns": [{"key": key, "label": label, "decimals": decimals} for key, label, decimals in (
            ("forced_tau_shipped", "τ forced, shipped", 2), ("forced_tau_serving", "τ forced, serving", 2),
            ("forced_tau_candidate", "τ forced, candidate", 2),
            ("tau_shipped", "τ decoded, shipped", 2), ("tau_serving", "τ decoded, serving", 2),
            ("count", "slices", 0), ("p50_s", "p50 (s)", 3), ("p90_s", "p90 (s)", 3),
            ("max_s", "max (s)", 3))],
        "rows": rows,
    }
    write_record(args.record, record, setting="a virtual machine, shared with other work")


if __name__ == "__main__":
    raise SystemExit(main())
