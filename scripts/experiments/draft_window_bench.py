"""The draft sliding window on the embedded pair at a long context: plain decoding, DFlash with
an unbounded drafter cache, and DFlash with windows of N rows, interleaved per prompt; τ,
decode tokens/s, the drafter's context cache (draft KV) at the end of each run, and whether the
output equals plain's token for token. Writes a record for scripts/render_benchmarks.py.

Each prompt is ~`--context-tokens` of held-out prompts of the bench's `embedded` set, followed by
one more as the question.

    .venv/bin/python scripts/experiments/draft_window_bench.py --engines transformers,mlx --windows 256,1024 \\
        --out docs/records/draft-window-embedded.json
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

from dflash_local.bench.datasets import embedded_prompts
from dflash_local.bench.report import write_record
from dflash_local.cli.flags import draft_window_arg
from dflash_local.engines import load_engine
from dflash_local.events import AUTO, GenerationParams, GenerationStats
from dflash_local.pairs.default_pair import pair_names

MiB = 1024 * 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="transformers")
    parser.add_argument("--windows", default=(256, 1024), metavar="N[,N]",
                        type=lambda text: tuple(draft_window_arg(w) for w in text.split(",")),
                        help="windows measured beside none, each an integer >= 1")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--context-tokens", type=int, default=1800)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    windows = [None, *args.windows]
    rows, prompt_lengths = [], []
    for engine_name in args.engines.split(","):
        engine = load_engine(engine_name, *pair_names(None, None, speculative=True))
        try:
            engine.calibrate()  # auto's round costs (cached per machine and pair)
            prompts = long_prompts(engine, args.prompts, args.context_tokens)
            prompt_lengths += [len(ids) for ids in prompts]
            rows += measure(engine, prompts, windows, args.max_tokens)
        finally:
            engine.close()
    record = make_record(args, rows, prompt_lengths)
    if args.out:
        record = write_record(args.out, record, setting="a shared virtual machine")
    print(json.dumps(record, indent=2, ensure_ascii=False))
    return 0


def long_prompts(engine, count: int, context_tokens: int) -> list[list[int]]:
    """Held-out prompts run together until ~context_tokens, then a question: each prompt starts
    at a different held-out prompt."""
    held_out = [prompt.turns[0] for prompt in embedded_prompts(1_000_000)]
    prompts = []
    for index in range(count):
        start, parts = index * len(held_out) // count, []
        while True:
            parts.append(held_out[(start + len(parts)) % len(held_out)])
            text = "Notes:\n\n" + "\n\n".join(parts[:-1]) + "\n\nNow answer this: " + parts[-1]
            ids = engine.encode_chat([{"role": "user", "content": text}])
            if len(ids) >= context_tokens:
                prompts.append(ids)
                break
    return prompts


def measure(engine, prompts: list[list[int]], windows: list[int | None], max_tokens: int):
    caches = []  # the drafter sessions of the current run
    real = type(engine).make_drafter.__get__(engine)
    engine.make_drafter = lambda window=None: caches.append(real(window)) or caches[-1]
    names = ["plain"] + [f"DFlash auto, window {w}" if w else "DFlash auto, no window"
                         for w in windows]
    totals = {name: {"stats": [], "kv": 0, "identical": 0} for name in names}
    for prompt_ids in prompts:
        plain_tokens = None
        for name, window in zip(names, [0, *windows]):
            caches.clear()
            params = GenerationParams(max_tokens=max_tokens, speculative=name != "plain",
                                      block_size=AUTO, draft_window=window or None,
                                      stop_token_ids=(-1,))  # every run makes max_tokens
            stats, tokens = GenerationStats(), []
            for event in engine.stream(prompt_ids, params):
                stats.add(event)
                tokens.extend(event.token_ids)
            plain_tokens = plain_tokens or tokens
            entry = totals[name]
            entry["stats"].append(stats)
            entry["identical"] += tokens == plain_tokens
            entry["kv"] = max(entry["kv"], *(cache_bytes(session) for session in caches), 0)
    plain_rate = rate(totals["plain"]["stats"])
    return [row(engine.name, name, totals[name], plain_rate, len(prompts)) for name in names]


def cache_bytes(session) -> int:
    """Bytes the drafter's context cache holds now (MLX: its buffers, allocated 256 rows at a
    time; Transformers: the kept tensors)."""
    cache = session.cache
    if hasattr(cache, "layers"):
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers
                   if layer.keys is not None)
    return sum(k.nbytes + v.nbytes for k, v in zip(cache.keys, cache.values) if k is not None)


def rate(stats: list[GenerationStats]) -> float:
    return sum(s.completion_tokens - 1 for s in stats) / sum(s.decode_s for s in stats)


def row(engine_name: str, name: str, entry: dict, plain_rate: float, prompts: int) -> dict:
    stats = entry["stats"]
    tokens_per_s = rate(stats)
    committed = sum(sum(s.accepted_per_round) for s in stats)
    rounds = sum(s.rounds for s in stats)
    label = f"{'Transformers' if engine_name == 'transformers' else 'MLX'}, {name}"
    speedup = None if name == "plain" else {"speedup": round(tokens_per_s / plain_rate, 2),
                                           "tau": round(committed / rounds, 2)}
    return {"label": label, "tokens_per_s": round(tokens_per_s, 1), "speedup": speedup,
            "draft_kv_mib": None if name == "plain" else round(entry["kv"] / MiB, 2),
            "identical": f"{entry['identical']}/{prompts}"}


def make_record(args, rows: list[dict], prompt_lengths: list[int]) -> dict:
    command = " ".join(["scripts/experiments/draft_window_bench.py", *sys.argv[1:]])
    return {
        "title": "The draft sliding window at a long context",
        "measured": ("Plain decoding, DFlash auto with the drafter's whole context, and DFlash "
                     "auto with a draft sliding window, interleaved per prompt on the embedded "
                     "pair; draft KV is the drafter's context cache at the end of a run."),
        "command": f".venv/bin/python {command}",
        "date": datetime.now(UTC).date().isoformat(),
        "engine": args.engines.replace(",", ", "),
        "dataset": (f"{args.prompts} prompts of {min(prompt_lengths)}-{max(prompt_lengths)} "
                    f"tokens: held-out prompts of the embedded set run together, then a question"),
        "settings": {"drafter": "smollm2-135m-dflash (DFlash 2)", "dtype": "float32",
                     "temperature": 0, "max_tokens": args.max_tokens, "block_size": "auto"},
        "row_header": "method",
        "columns": [{"key": "tokens_per_s", "label": "tokens/s", "decimals": 1},
                    {"key": "speedup", "label": "speedup (τ)"},
                    {"key": "draft_kv_mib", "label": "draft KV (MiB)", "decimals": 2},
                    {"key": "identical", "label": "identical to plain"}],
        "rows": rows,
        "source": "scripts/experiments/draft_window_bench.py",
    }


if __name__ == "__main__":
    sys.exit(main())
