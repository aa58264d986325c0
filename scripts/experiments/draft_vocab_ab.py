"""Drafting over the draft vocabulary vs the full head, side by side in one run.

    .venv/bin/python scripts/experiments/draft_vocab_ab.py [--engine transformers|mlx] [--datasets embedded,humaneval]
        [--samples 6] [--tokens 128] [--block-size auto] [--recalibrate]

Two engines over the same shipped pair, one drafting from `draft_vocab.json` and one from the
whole vocabulary, each with its own calibration (its draft pass costs differ: printed first).
Per prompt, interleaved: plain, then both speculative runs; every output must equal plain.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from dflash_local import paths
from dflash_local.bench.datasets import load_prompts
from dflash_local.bench.measure import run_ours, summarize
from dflash_local.cli.flags import block_size_arg
from dflash_local.events import AUTO, GenerationParams
from dflash_local.pairs.embedded import embedded_target_dir

DRAFTER = paths.shipped_models_dir() / "smollm2-135m-dflash"


def load(engine_name: str, draft_vocab: bool):
    if engine_name == "mlx":
        from dflash_local.engines import engine_class_for
        return engine_class_for("mlx")(embedded_target_dir(), DRAFTER, draft_vocab=draft_vocab)
    from dflash_local.engines.torch_engine import TorchEngine
    return TorchEngine(embedded_target_dir(), DRAFTER, draft_vocab=draft_vocab)


def draft_pass_cost(engine, recalibrate: bool) -> str:
    """The calibration's draft pass (round minus verify) per width, in 1-token steps."""
    costs = engine.calibrate(force=recalibrate).costs
    step = costs.verify_only[0]
    extra = [(r - v) / step for r, v in zip(costs.seconds, costs.verify_only)]
    return " ".join(f"w{w + 1}={x:.2f}" for w, x in enumerate(extra) if w + 1 in (2, 4, 8, 16))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["transformers", "mlx"], default="transformers")
    parser.add_argument("--datasets", default="embedded,humaneval")
    parser.add_argument("--samples", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--block-size", default=AUTO, type=block_size_arg,
                        help="auto or a fixed width")
    parser.add_argument("--recalibrate", action="store_true")
    args = parser.parse_args()
    engines = {"draft vocab": load(args.engine, True), "full head": load(args.engine, False)}
    for name, engine in engines.items():
        print(f"{name} ({engine.pair.draft_vocab_size or 'all'} ids): draft pass / step "
              f"{draft_pass_cost(engine, args.recalibrate)}", flush=True)
    plain_engine = engines["draft vocab"]
    for dataset in args.datasets.split(","):
        runs: dict[str, list] = {"plain": [], **{name: [] for name in engines}}
        identical = 0
        for prompt in load_prompts(dataset, args.samples):
            ids = plain_engine.encode_chat([{"role": "user", "content": prompt.turns[0]}])
            params = GenerationParams(max_tokens=args.tokens, stop_token_ids=tuple(plain_engine.eos_token_ids))
            runs["plain"].append(run_ours(plain_engine, ids, replace(params, speculative=False)))
            for name, engine in engines.items():
                runs[name].append(run_ours(engine, ids, replace(params, block_size=args.block_size)))
            identical += all(runs[name][-1].token_ids == runs["plain"][-1].token_ids for name in engines)
        print(f"\n{dataset}: {identical}/{len(runs['plain'])} identical to plain")
        for name, method_runs in runs.items():
            summary = summarize(method_runs, runs["plain"])
            print(f"  {name:12s} {summary['decode_tokens_per_s']:6.2f} tok/s  {summary['speedup']:.3f}x"
                  + (f"  τ {summary['tau']:.2f}  rounds {summary.get('rounds_by_mode')}" if "tau" in summary else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
