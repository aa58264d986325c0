"""Which adaptation settings raise τ: the embedded pair's greedy replies to a stream of prompts of
one kind are recorded once (cached), then for each setting a fresh candidate trains on them as
the idle rounds would (a round every `min_new_replies` replies, `steps_per_new_reply` steps each,
replay of the shipped data at `replay_share`), and its teacher-forced τ on held-out replies of
the same kind and of the general kind (forgetting) is set against the shipped drafter's. Not run
in CI (minutes per setting); the Transformers engine, in-process (no service).

    nice .venv/bin/python scripts/adapt_tune.py --record docs/records/adapt-tune-embedded.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# (label, AdaptSettings fields, steps per new reply, blocks per step, trained layers: None = all)
SETTINGS = {
    "shipped": None,
    "lr3e-5 s4": ({"lr": 3e-5}, 4, 4, None),
    "lr3e-5 s16": ({"lr": 3e-5}, 16, 4, None),
    "lr1e-4 s4": ({"lr": 1e-4}, 4, 4, None),
    "lr1e-4 s4 replay0.8": ({"lr": 1e-4, "replay_share": 0.8}, 4, 4, None),
    "lr3e-4 s4": ({"lr": 3e-4}, 4, 4, None),
    "lr1e-3 s4": ({"lr": 1e-3}, 4, 4, None),
    "lr1e-4 s16": ({"lr": 1e-4}, 16, 4, None),
    "lr1e-3 s4 last-layer": ({"lr": 1e-3}, 4, 4, "last"),
}


def recorded_replies(engine, kind: str, count: int, max_tokens: int, cache: Path) -> list[list]:
    """[prompt ids, reply ids] of the target's greedy replies to the first `count` prompts."""
    from dflash_local.bench.datasets import load_prompts
    from dflash_local.events import GenerationParams

    if cache.is_file():
        return json.loads(cache.read_text())
    pairs = []
    for prompt in load_prompts(kind, count):
        prompt_ids = engine.encode_chat([{"role": "user", "content": prompt.turns[0]}])
        reply = [t for e in engine.stream(prompt_ids, GenerationParams(max_tokens=max_tokens))
                 for t in e.token_ids]
        pairs.append([prompt_ids, reply])
    cache.write_text(json.dumps(pairs))
    return pairs


def tapped(teacher, trainer_settings, replies) -> list[dict]:
    """The replies as training sequences with the target's taps."""
    from dflash_local.adapt.trainer import training_sequence

    return [with_taps(teacher, training_sequence(prompt_ids, reply_ids, trainer_settings))
            for prompt_ids, reply_ids in replies]


def with_taps(teacher, sequence: dict) -> dict:
    sequence = dict(sequence)
    chunks = teacher.taps(sequence["tokens"], lambda: 512)
    try:
        while True:
            next(chunks)
    except StopIteration as done:
        sequence["taps"] = done.value
    return sequence


def forced_tau(trainer, state, sequences) -> float:
    from dflash_local.adapt.idle import evenly_spaced

    accepted = []
    for sequence in sequences:
        anchors = evenly_spaced(sequence, 32)
        accepted += trainer.accepted(state, sequence, anchors)
    return 1 + statistics.fmean(accepted)


def train(adaptation, setting, stream: list[dict], replay: list[dict]) -> tuple[dict, float]:
    """The candidate's weights after the stream, rounds as adapt/idle.py runs them, and seconds."""
    import torch

    from dflash_local.adapt.trainer import AdaptSettings, DrafterTrainer

    fields, steps_per_reply, blocks, layers = setting
    settings = dataclasses.replace(AdaptSettings(), **fields)
    trainer = DrafterTrainer(adaptation.trainer.shipped_path, adaptation.teacher.model,
                             adaptation.draft_ids, settings, pull=False)
    if layers == "last":
        last = f"layers.{len(trainer.candidate.layers) - 1}."
        for name, param in trainer.candidate.named_parameters():
            param.requires_grad = last in name
        trainer._params = [p for p in trainer.candidate.parameters() if p.requires_grad]
        trainer.optimizer = torch.optim.AdamW(trainer._params, lr=settings.lr, betas=(0.9, 0.95))
    rng, started = random.Random(0), time.perf_counter()
    round_every = 4
    for end in range(round_every, len(stream) + 1, round_every):
        pool = stream[:end]
        for _ in range(steps_per_reply * round_every):
            sequences = [rng.choice(pool)]
            if replay and rng.random() < settings.replay_share:
                sequences.append(rng.choice(replay))
            trainer.step(sequences, blocks)
    return trainer.candidate_state(), time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", default="humaneval")
    parser.add_argument("--stream", type=int, default=48, help="replies trained on")
    parser.add_argument("--held-out", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--only", nargs="*", help="these settings' labels only")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "adapt-tune")
    parser.add_argument("--record", type=Path)
    args = parser.parse_args()
    import torch

    from dflash_local.adapt.idle import build_adaptation
    from dflash_local.adapt.record import ReplyRecorder, recorded_pair
    from dflash_local.drafter.draft_vocab import load_draft_vocab
    from dflash_local.engines.torch_engine import TorchEngine
    from dflash_local.pairs.default_pair import EMBEDDED_DRAFTER_DIR, embedded_target
    from dflash_local.paths import shipped_models_dir

    torch.manual_seed(0)
    target = embedded_target()
    os.environ["DFLASH_LOCAL_HOME"] = tempfile.mkdtemp(prefix="adapt-tune-")  # not the user's store
    engine = TorchEngine(target, shipped_models_dir() / EMBEDDED_DRAFTER_DIR)
    recorder = ReplyRecorder(recorded_pair(engine.pair, ("embedded", "smollm2-135m-dflash")))
    adaptation = build_adaptation(engine, recorder)
    adaptation.draft_ids = load_draft_vocab(engine.pair.drafter_path, engine.drafter.config.vocab_size)
    args.cache.mkdir(parents=True, exist_ok=True)
    tag = f"{args.max_tokens}t"
    kind = recorded_replies(engine, args.kind, args.stream + args.held_out, args.max_tokens,
                            args.cache / f"{args.kind}-{args.stream + args.held_out}-{tag}.json")
    general = recorded_replies(engine, "embedded", args.held_out, args.max_tokens,
                               args.cache / f"embedded-{args.held_out}-{tag}.json")
    settings = adaptation.trainer.settings
    stream = tapped(adaptation.teacher, settings, kind[: args.stream])
    held = tapped(adaptation.teacher, settings, kind[args.stream:])
    general_seqs = tapped(adaptation.teacher, settings, general)
    replay = [with_taps(adaptation.teacher, sequence) for sequence in adaptation.replay]
    rows = []
    for label, setting in SETTINGS.items():
        if args.only and label not in args.only and label != "shipped":
            continue
        state, seconds = ((adaptation.trainer.shipped, 0.0) if setting is None
                          else train(adaptation, setting, stream, replay))
        row = {"label": label, "tau_kind": round(forced_tau(adaptation.trainer, state, held), 3),
               "tau_general": round(forced_tau(adaptation.trainer, state, general_seqs), 3),
               "train_s": round(seconds, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.record:
        write_record(args, rows)
    return 0


def write_record(args, rows: list[dict]) -> None:
    record = {
        "title": "Adaptation settings: held-out τ after a stream of one kind",
        "measured": __doc__.split("\n\n")[0].replace("\n", " "),
        "command": "nice .venv/bin/python scripts/adapt_tune.py " + " ".join(sys.argv[1:]),
        "date": datetime.date.today().isoformat(),
        "machine": "2-core AMD EPYC (a virtual machine, shared with other work)",
        "engine": "Transformers", "dataset": f"{args.kind} (stream and held-out), embedded (general)",
        "settings": {"pair": "embedded (SmolLM2-135M-Instruct + smollm2-135m-dflash)",
                     "stream": args.stream, "held_out": args.held_out, "max_tokens": args.max_tokens,
                     "grid": {label: None if s is None else {"trainer": s[0], "steps_per_new_reply": s[1],
                                                             "blocks_per_step": s[2], "layers": s[3] or "all"}
                              for label, s in SETTINGS.items() if label in {row["label"] for row in rows}}},
        "row_header": "setting", "source": "scripts/adapt_tune.py",
        "compares": "teacher-forced τ of the shipped drafter and of candidates trained with each setting",
        "columns": [{"key": "tau_kind", "label": f"τ forced, held-out {args.kind}", "decimals": 2},
                    {"key": "tau_general", "label": "τ forced, held-out general", "decimals": 2},
                    {"key": "train_s", "label": "training (s)", "decimals": 0}],
        "rows": rows,
    }
    args.record.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    raise SystemExit(main())
