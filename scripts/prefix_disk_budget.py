"""The prefix cache's disk tier under many conversations: does it hold its budget? Not run in CI
(a hundred generations); the embedded pair by default.

    .venv/bin/python scripts/prefix_disk_budget.py --engine transformers --conversations 50 \
        --record docs/records/prefix-disk-budget.json
    .venv/bin/python scripts/render_benchmarks.py

Each conversation has a system prompt of its own and two turns; every first turn runs, then
every second turn, the latest conversation first (interleaved: each write may evict another
conversation's entry; a user returns to recent chats first). The RAM tier gets 1 MiB, less than
one entry, so a second turn's prefix can only come from disk: "from disk" counts the second
turns that found their own first turn there. After each turn its entry is written (the writer
flushed) and the bytes every entry holds on disk are summed: the most seen is set against the
budget.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TOPICS = ("rivers", "lakes", "mountains", "deserts", "forests", "islands", "glaciers", "caves",
          "volcanoes", "canyons")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["mlx", "transformers"], default="transformers")
    parser.add_argument("--conversations", type=int, default=50)
    parser.add_argument("--disk-mb", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--record", type=Path, help="the JSON record this run's row goes into")
    args = parser.parse_args()
    from dflash_local.engines import engine_class_for
    from dflash_local.pairs.default_pair import EMBEDDED_DRAFTER_DIR, embedded_target
    from dflash_local.paths import shipped_models_dir

    target, drafter = embedded_target(), shipped_models_dir() / EMBEDDED_DRAFTER_DIR
    home = tempfile.mkdtemp(prefix="prefix-disk-budget-")
    os.environ["DFLASH_LOCAL_HOME"] = home
    try:
        engine = engine_class_for(args.engine)(target, drafter, prefix_cache_mb=1,
                                               prefix_cache_disk_mb=args.disk_mb)
        row = _run(engine, args)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    print(json.dumps(row))
    if args.record:
        _record(args, row)
    return 0 if row["within"] == "yes" else 1


def _run(engine, args: argparse.Namespace) -> dict:
    """Every first turn, then every second turn; the bytes on disk after each write."""
    from dflash_local.engines.local import prefix_cache_root
    from dflash_local.method.prefix_disk import cache_bytes

    talks = [[{"role": "system", "content": f"Conversation {index}: you are a guide to "
                                            f"{TOPICS[index % len(TOPICS)]}. " * 6},
              {"role": "user", "content": "Name three of them, briefly."}]
             for index in range(args.conversations)]
    held, from_disk, first_lengths = [], 0, []
    for turn in (1, 2):
        for talk in talks if turn == 1 else reversed(talks):
            reply, tier, cached = _turn(engine, talk, args.max_tokens)
            if turn == 1:
                first_lengths.append(len(engine.encode_chat(talk)))
                talk += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": "And one more?"}]
            else:  # its own first turn, not another's shared opening
                from_disk += tier == "disk" and cached >= first_lengths[talks.index(talk)]
            engine.prefix_disk.flush()
            held.append(cache_bytes(prefix_cache_root()))
    status = engine.prefix_disk.status()
    mib = 1 << 20
    return {"conversations": args.conversations, "budget": status["budget_bytes"] / mib,
            "held": max(held) / mib, "within": "yes" if max(held) <= status["budget_bytes"] else "NO",
            "entries": status["entries"], "from_disk": f"{from_disk}/{args.conversations}"}


def _turn(engine, messages: list[dict], max_tokens: int) -> tuple[str, str | None, int]:
    """(reply text, the tier that served its prefix, cached tokens), greedy, block size 8."""
    from dflash_local.events import GenerationParams, GenerationStats, parse_block_size

    params = GenerationParams(max_tokens=max_tokens, block_size=parse_block_size(8),
                              temperature=0.0)
    stats, tokens = GenerationStats(), []
    for event in engine.stream(engine.encode_chat(messages), params):
        stats.add(event)
        tokens.extend(event.token_ids)
    return engine.decode(tokens), stats.cached_tier, stats.cached_tokens


COLUMNS = [("conversations", "conversations", 0), ("budget", "budget (MiB)", 0),
           ("held", "most held (MiB)", 2), ("within", "within budget", 0),
           ("entries", "entries at the end", 0), ("from_disk", "second turns from disk", 0)]


def _record(args: argparse.Namespace, row: dict) -> None:
    from dflash_local.bench.report import write_record

    label = {"mlx": "MLX", "transformers": "Transformers"}[args.engine]
    record = {
        "title": "The prefix cache's disk tier under interleaved conversations: its budget held",
        "measured": __doc__.split("\n\n")[2].replace("\n", " ").strip(),
        "command": (f"nice scripts/prefix_disk_budget.py --engine {args.engine} --conversations "
                    f"{args.conversations} --disk-mb {args.disk_mb} --record {args.record}"),
        "date": datetime.date.today().isoformat(),
        "engine": label, "dataset": "generated: a system prompt per conversation, two turns",
        "settings": {"pair": "embedded (SmolLM2-135M-Instruct + smollm2-135m-dflash)",
                     "dtype": "float32", "temperature": 0, "block_size": 8,
                     "max_tokens": args.max_tokens, "ram_tier": "1 MiB (less than one entry)"},
        "row_header": "run", "source": "scripts/prefix_disk_budget.py",
        "columns": [{"key": key, "label": label, "decimals": decimals}
                    for key, label, decimals in COLUMNS],
        "rows": [{"label": label, **{key: round(value, 2) if isinstance(value, float) else value
                                     for key, value in row.items()}}]}
    write_record(args.record, record, setting="a virtual machine")


if __name__ == "__main__":
    raise SystemExit(main())
