"""Side by side in one process: the speculative loop with and without two of its parts, on the
embedded pair, each prompt's runs back to back (a shared machine's drift hits every variant alike).

    .venv/bin/python scripts/experiments/ab_loop_variants.py [--engine transformers|mlx] [--samples 30]
        [--max-tokens 128] [--context N] [--variants sdpa,mlx-stock,no-graft,graft,flat]
        [--out runs/ab-loop.json]

Variants, each with its own calibration measured in this process:
- "sdpa": Transformers' stock attention (Transformers engine only: skipped, and said, on MLX),
  no lookup grafts;
- "mlx-stock": mlx-lm's stock attention for the target (MLX engine only: skipped, and said, on
  Transformers; the drafter keeps dflash_local/accel/mlx_attention.py), as shipped otherwise;
- "no-graft": the engine's attention (on a CPU: accel/torch_attention.py for Transformers,
  dflash_local/accel/mlx_attention.py for MLX), no lookup grafts;
- "graft": the engine as shipped: lookup drafts grafted onto drafter trees;
- "flat": as shipped, but its calibration without context slopes (every round priced as on
  the calibration's short context; graft's calibration, the slopes dropped).
"No-graft" makes `planning.auto.AutoPlanner._graft_length` graft nothing: an A/B of the
loop's internals, not a user setting. --context N puts held-out text from the end of the list
(never one of the sampled prompts) before each prompt until it is N tokens long: a long chat.
Every run is greedy, block size auto, lookup and trees on, and must equal plain decoding token
for token (the script stops otherwise). Plain decoding runs once per attention the variants
use, and each variant's speedup is against plain decoding with its own attention; where two
attentions' plain outputs differ (float rounding can flip a near-tie), the prompt says so.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from dflash_local import paths
from dflash_local.bench.datasets import load_prompts
from dflash_local.bench.measure import run_ours
from dflash_local.events import AUTO, GenerationParams
from dflash_local.method import calibration
from dflash_local.method.planning.auto import AutoPlanner
from dflash_local.pairs.embedded import embedded_target_dir

_SHIPPED_GRAFT = AutoPlanner._graft_length


def _no_graft(self, tree, lookup, drafted_width, held):
    return 0


def _engine(name: str):
    drafter = paths.shipped_models_dir() / "smollm2-135m-dflash"
    if name == "mlx":
        from dflash_local.engines import engine_class_for

        return engine_class_for("mlx")(embedded_target_dir(), drafter)
    from dflash_local.engines.torch_engine import TorchEngine

    return TorchEngine(embedded_target_dir(), drafter)


def _variants(engine, wanted: list[str]) -> dict[str, tuple[str, bool]]:
    """name -> (attention implementation to set; grafts on)."""
    if engine.name == "mlx":
        from dflash_local.accel.mlx_attention import NAME, attention_modules, cpu_attention

        routed = all(getattr(module, NAME) is cpu_attention for module in attention_modules(engine.model))
        shipped = "mlx-cpu" if routed else "mlx-stock"
    else:
        shipped = engine.model.config._attn_implementation
    variants = {}
    if shipped != "sdpa" and engine.name != "mlx":
        variants["sdpa"] = ("sdpa", False)
    if shipped != "mlx-stock" and engine.name == "mlx":
        variants["mlx-stock"] = ("mlx-stock", True)
    variants["no-graft"] = (shipped, False)
    variants["graft"] = (shipped, True)
    variants["flat"] = (shipped, True)
    elsewhere = {"sdpa", "mlx-stock"} - set(variants)  # the other engine's attention
    unknown = [name for name in wanted if name not in variants and name not in elsewhere]
    if unknown:
        sys.exit(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(sorted({*variants, *elsewhere}))}")
    for name in sorted(elsewhere & set(wanted)):
        print(f"variant {name}: not for the {engine.name} engine, skipped", flush=True)
    # graft first when both are asked: flat is graft's calibration without its slopes
    order = sorted(wanted, key=lambda name: (name != "graft" or "flat" not in wanted))
    return {name: variants[name] for name in order if name in variants}


def _with_context(engine, text: str, tokens: int, filler: list[str]) -> list[int]:
    """The prompt's chat ids, with filler text before it until about `tokens` long."""
    notes: list[str] = []
    while True:
        ids = engine.encode_chat([{"role": "user", "content": "\n\n".join([*notes, text])}])
        if len(ids) >= tokens or len(notes) == len(filler):
            return ids
        notes.append(filler[len(notes)])


def _use(engine, attention: str, graft: bool) -> None:
    if engine.name == "mlx":  # imported here: mlx-lm only where the engine is MLX's
        from mlx_lm.models.base import scaled_dot_product_attention as stock

        from dflash_local.accel.mlx_attention import cpu_attention, set_attention

        set_attention(engine.model, cpu_attention if attention == "mlx-cpu" else stock)
    elif engine.model.config._attn_implementation != attention:
        engine.model.set_attn_implementation(attention)
    AutoPlanner._graft_length = _SHIPPED_GRAFT if graft else _no_graft


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=["transformers", "mlx"], default="transformers")
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--context", type=int, default=0, metavar="N")
    parser.add_argument("--variants", default="sdpa,no-graft,graft,flat")
    parser.add_argument("--out", type=Path, default=Path("runs/ab-loop.json"))
    args = parser.parse_args()
    engine = _engine(args.engine)
    variants = _variants(engine, args.variants.split(","))
    policies = {}
    for name, (attention, graft) in variants.items():
        _use(engine, attention, graft)
        if name == "flat" and "graft" in policies:
            measured = policies["graft"]
        else:
            measured = calibration.measure(engine, calibration.calibration_key(
                engine.pair, engine.compute_threads()))
        if name == "flat":
            measured = replace(measured, costs=replace(measured.costs, context_slopes=None))
        policies[name] = measured
        costs = policies[name].costs
        print(f"calibrated {name}: a {costs.max_width}-row verify = "
              f"{costs.verify_only[-1] / costs.at(1):.2f} plain steps", flush=True)
    attentions = sorted({attention for attention, _ in variants.values()})
    totals = {name: [0.0, 0] for name in [*(f"plain {a}" for a in attentions), *variants]}
    taus = {name: [0, 0] for name in variants}
    names = list(variants)
    prompts = load_prompts("embedded", args.samples)
    sampled = {prompt.turns[0] for prompt in prompts}
    filler = [text for text in reversed([p.turns[0] for p in load_prompts("embedded", 10_000)])
              if text not in sampled]
    for index, prompt in enumerate(prompts):
        prompt_ids = _with_context(engine, prompt.turns[0], args.context, filler)
        line, plains = [], {}
        for attention in attentions[index % len(attentions):] + attentions[: index % len(attentions)]:
            _use(engine, attention, graft=True)
            plain = plains[attention] = run_ours(
                engine, prompt_ids, GenerationParams(max_tokens=args.max_tokens, speculative=False))
            totals[f"plain {attention}"][0] += plain.decode_s
            totals[f"plain {attention}"][1] += plain.completion_tokens - 1
            line.append(f"plain {attention} {plain.decode_tokens_per_s:.1f}")
        if len({tuple(run.token_ids) for run in plains.values()}) > 1:
            line.append("(plain outputs differ between attentions)")
        for name in names[index % len(names):] + names[: index % len(names)]:  # rotate the order
            attention, graft = variants[name]
            _use(engine, attention, graft)
            engine.calibration = policies[name]
            run = run_ours(engine, prompt_ids, GenerationParams(max_tokens=args.max_tokens, block_size=AUTO))
            if run.token_ids != plains[attention].token_ids:
                sys.exit(f"{prompt.prompt_id}: {name} differs from plain decoding")
            totals[name][0] += run.decode_s
            totals[name][1] += run.completion_tokens - 1
            taus[name][0] += sum(run.committed_per_round)
            taus[name][1] += len(run.committed_per_round)
            line.append(f"{name} {run.decode_tokens_per_s:.1f}")
        print(f"[{index + 1}/{args.samples}] {prompt.prompt_id}: " + ", ".join(line), flush=True)
    plain_rates = {a: totals[f"plain {a}"][1] / totals[f"plain {a}"][0] for a in attentions}
    summary = {"engine": args.engine, "samples": args.samples, "max_tokens": args.max_tokens,
               "context": args.context, "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "plain_tokens_per_s": {a: round(rate, 2) for a, rate in plain_rates.items()},
               "variants": {}}
    for attention, rate in plain_rates.items():
        print(f"plain {attention:10} {rate:6.1f} tokens/s", flush=True)
    for name, (attention, _) in variants.items():
        rate, plain_rate = totals[name][1] / totals[name][0], plain_rates[attention]
        summary["variants"][name] = {"attention": attention, "tokens_per_s": round(rate, 2),
                                     "speedup": round(rate / plain_rate, 3),
                                     "tau": round(taus[name][0] / max(taus[name][1], 1), 3)}
        summary["variants"][name]["calibration"] = policies[name].to_json()
        print(f"{name:10} {rate:6.1f} tokens/s  {rate / plain_rate:.2f}x  "
              f"tau {summary['variants'][name]['tau']:.2f}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"record: {args.out}")


if __name__ == "__main__":
    main()
