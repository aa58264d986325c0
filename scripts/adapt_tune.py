"""Which adaptation settings raise τ: the embedded pair's greedy replies to a stream of prompts of
one kind are recorded once (cached), then for each setting a fresh candidate trains on them as
the idle rounds would (a round every `min_new_replies` replies, `steps_per_new_reply` steps each,
replay of the shipped data at `replay_share`), and its teacher-forced τ on held-out replies of
the same kind and of the general kind (forgetting) is set against the shipped drafter's. Not run
in CI (minutes per setting); the Transformers engine, in-process (no service).

    nice .venv/bin/python scripts/adapt_tune.py --replies 100 --record docs/records/adapt-tune-embedded.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@dataclass(frozen=True)
class Setting:
    trainer: dict = field(default_factory=dict)  # AdaptSettings fields
    steps_per_new_reply: int = 16
    blocks_per_step: int = 4
    layers: str = "all"  # or "last"
    newest_share: float = 0.0  # of the steps, those that draw from the latest round's replies only
    lr_decay: float = 0.0  # the lr of round r: lr / (1 + lr_decay * r)


SETTINGS: dict[str, Setting | None] = {
    "shipped": None,
    "lr3e-5 s16": Setting({"lr": 3e-5}, 16),
    "lr5e-5 s16": Setting({"lr": 5e-5}, 16),
    "lr3e-5 s16 newest0.5": Setting({"lr": 3e-5}, 16, newest_share=0.5),
    "lr1e-4 s16 decay": Setting({"lr": 1e-4}, 16, lr_decay=0.25),
    "lr3e-5 s16 replay0.8": Setting({"lr": 3e-5, "replay_share": 0.8}, 16),
    "lr3e-5 s32": Setting({"lr": 3e-5}, 32),
    "lr3e-5 s64": Setting({"lr": 3e-5}, 64),
    "lr3e-5 s16 b8": Setting({"lr": 3e-5}, 16, 8),
    "lr3e-5 s16 replay0.3": Setting({"lr": 3e-5, "replay_share": 0.3}, 16),
    "lr3e-5 s4": Setting({"lr": 3e-5}, 4),
    "lr1e-4 s4": Setting({"lr": 1e-4}, 4),
    "lr1e-4 s4 replay0.8": Setting({"lr": 1e-4, "replay_share": 0.8}, 4),
    "lr3e-4 s4": Setting({"lr": 3e-4}, 4),
    "lr1e-3 s4": Setting({"lr": 1e-3}, 4),
    "lr1e-4 s16": Setting({"lr": 1e-4}, 16),
    "lr1e-3 s4 last-layer": Setting({"lr": 1e-3}, 4, layers="last"),
}


def recorded_replies(engine, kind: str, count: int, max_tokens: int, cache: Path) -> list[list]:
    """[prompt ids, reply ids] of the target's greedy replies to the first `count` prompts, the
    longest cache of this kind and length reused and extended."""
    from dflash_local.bench.datasets import load_prompts
    from dflash_local.events import GenerationParams

    cached: list[list] = []
    for path in cache.glob(f"{kind}-*-{max_tokens}t.json"):
        pairs = json.loads(path.read_text())
        cached = pairs if len(pairs) > len(cached) else cached
    if len(cached) >= count:
        return cached[:count]
    for prompt in load_prompts(kind, count)[len(cached):]:
        prompt_ids = engine.encode_chat([{"role": "user", "content": prompt.turns[0]}])
        reply = [t for e in engine.stream(prompt_ids, GenerationParams(max_tokens=max_tokens))
                 for t in e.token_ids]
        cached.append([prompt_ids, reply])
    (cache / f"{kind}-{count}-{max_tokens}t.json").write_text(json.dumps(cached))
    return cached


def new_trainer(adaptation, setting: Setting):
    """A fresh candidate from the shipped weights with the setting's trainer fields and layers."""
    import torch

    from dflash_local.adapt.trainer import AdaptSettings, DrafterTrainer

    settings = dataclasses.replace(AdaptSettings(), **setting.trainer)
    trainer = DrafterTrainer(adaptation.trainer.shipped_path, adaptation.teacher.model,
                             adaptation.draft_ids, settings, pull=False)
    if setting.layers == "last":
        last = f"layers.{len(trainer.candidate.layers) - 1}."
        for name, param in trainer.candidate.named_parameters():
            param.requires_grad = last in name
        trainer._params = [p for p in trainer.candidate.parameters() if p.requires_grad]
        trainer.optimizer = torch.optim.AdamW(trainer._params, lr=settings.lr, betas=(0.9, 0.95))
    return trainer


def train(adaptation, setting: Setting, stream: list[dict], replay: list[dict]) -> tuple[dict, float]:
    """The candidate's weights after the stream, rounds as adapt/idle.py runs them, and seconds."""
    trainer = new_trainer(adaptation, setting)
    rng, started = random.Random(0), time.perf_counter()
    round_every = adaptation.settings.min_new_replies
    for round_index, end in enumerate(range(round_every, len(stream) + 1, round_every)):
        for group in trainer.optimizer.param_groups:
            group["lr"] = trainer.settings.lr / (1 + setting.lr_decay * round_index)
        pool, newest = stream[:end], stream[end - round_every:end]
        for _ in range(setting.steps_per_new_reply * round_every):
            sequences = [rng.choice(newest if rng.random() < setting.newest_share else pool)]
            if replay and rng.random() < trainer.settings.replay_share:
                sequences.append(rng.choice(replay))
            trainer.step(sequences, setting.blocks_per_step)
    return trainer.candidate_state(), time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", default="humaneval")
    parser.add_argument("--replies", "--stream", dest="replies", type=int, default=48,
                        help="replies of the kind trained on (the held-out ones follow them)")
    parser.add_argument("--held-out", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--only", nargs="*", help="these settings' labels only")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "adapt-tune")
    parser.add_argument("--record", type=Path)
    args = parser.parse_args()
    unknown = sorted(set(args.only or ()) - set(SETTINGS))
    if unknown:
        parser.error(f"--only: no setting named {unknown}; known: {list(SETTINGS)}")
    import torch

    from dflash_local.adapt.idle import build_adaptation
    from dflash_local.adapt.record import ReplyRecorder, recorded_pair
    from dflash_local.bench.adapt_forced import forced_tau, tapped_replies, with_taps
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
    kind = recorded_replies(engine, args.kind, args.replies + args.held_out, args.max_tokens, args.cache)
    general = recorded_replies(engine, "embedded", args.held_out, args.max_tokens, args.cache)
    teacher, settings = adaptation.teacher, adaptation.trainer.settings
    stream = tapped_replies(teacher, settings, kind[: args.replies])
    held = tapped_replies(teacher, settings, kind[args.replies:])
    general_seqs = tapped_replies(teacher, settings, general)
    replay = [with_taps(teacher, sequence) for sequence in adaptation.replay]
    rows: list[dict] = []
    for label, setting in SETTINGS.items():
        if args.only and label not in args.only and label != "shipped":
            continue
        state, seconds = ((adaptation.trainer.shipped, 0.0) if setting is None
                          else train(adaptation, setting, stream, replay))
        row = {"label": label, "tau_kind": round(forced_tau(adaptation.trainer, state, held), 3),
               "tau_general": round(forced_tau(adaptation.trainer, state, general_seqs), 3),
               "train_s": round(seconds, 1)}
        shipped = rows[0] if rows else row
        row["kind_ratio"] = round(row["tau_kind"] / shipped["tau_kind"], 3)
        row["general_ratio"] = round(row["tau_general"] / shipped["tau_general"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.record:  # after each row: a run stopped early keeps the rows it measured
            write_tune_record(args, rows)
    return 0


def write_tune_record(args, rows: list[dict]) -> None:
    from dflash_local.bench.report import write_record

    labels = {row["label"] for row in rows}
    record = {
        "title": "Adaptation settings: held-out τ after a stream of one kind",
        "measured": __doc__.split("\n\n")[0].replace("\n", " "),
        "command": "nice .venv/bin/python scripts/adapt_tune.py " + " ".join(
            f'"{word}"' if " " in word else word for word in sys.argv[1:]),
        "date": datetime.date.today().isoformat(),
        "engine": "Transformers", "dataset": f"{args.kind} (stream and held-out), embedded (general)",
        "settings": {"pair": "embedded (SmolLM2-135M-Instruct + smollm2-135m-dflash)",
                     "replies": args.replies, "held_out": args.held_out, "max_tokens": args.max_tokens,
                     "grid": {label: None if setting is None else dataclasses.asdict(setting)
                              for label, setting in SETTINGS.items() if label in labels}},
        "row_header": "setting", "source": "scripts/adapt_tune.py",
        "compares": f"teacher-forced τ of the shipped drafter and of candidates trained with each setting "
                    f"on {args.replies} replies of one kind",
        "columns": [{"key": "tau_kind", "label": f"τ forced, held-out {args.kind}", "decimals": 2},
                    {"key": "tau_general", "label": "τ forced, held-out general", "decimals": 2},
                    {"key": "kind_ratio", "label": "× shipped (kind)", "decimals": 2},
                    {"key": "general_ratio", "label": "× shipped (general)", "decimals": 2},
                    {"key": "train_s", "label": "training (s)", "decimals": 0}],
        "rows": rows,
    }
    write_record(args.record, record, setting="a virtual machine, shared with other work")


if __name__ == "__main__":
    raise SystemExit(main())
