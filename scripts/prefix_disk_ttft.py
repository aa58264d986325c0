"""Time to first token of a conversation's second turn after a restart, from the prefix cache's
disk tier, against the same prompt computed cold and served from RAM; outputs compared token for
token. Not run in CI (it prefills thousands of tokens); the embedded pair by default.

    .venv/bin/python scripts/prefix_disk_ttft.py --engine mlx --tokens 6000 \
        --record docs/records/prefix-disk-ttft.json
    .venv/bin/python scripts/render_benchmarks.py

A restart is a new engine object on the same data dir (a temporary DFLASH_LOCAL_HOME): its RAM
tier is empty, so the second turn's prefix can only come from disk; the same request again is
served from RAM. A restart with the service load's preload (`preload_prefix_cache`: the
latest entries read into RAM) is timed too, the preload apart. Times are wall clock from the request to its
first token (a disk read and restore included).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["mlx", "transformers"], default="mlx")
    parser.add_argument("--tokens", type=int, default=6000, help="the first turn's prompt length")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--record", type=Path, help="the JSON record that gets this engine's row")
    args = parser.parse_args()
    target, drafter = _embedded_pair()  # from the user's data dir, before the home moves
    home = tempfile.mkdtemp(prefix="prefix-disk-ttft-")
    os.environ["DFLASH_LOCAL_HOME"] = home
    try:
        return _measure(args, target, drafter)
    finally:
        shutil.rmtree(home, ignore_errors=True)  # a 6K-token entry is hundreds of MB


def _measure(args: argparse.Namespace, target: Path, drafter: Path) -> int:
    make = _engine_class(args.engine)
    first_prompt = _prompt(make(target, drafter, prefix_cache=False), args.tokens)
    writer = make(target, drafter, prefix_cache_disk_mb=4096)
    reply, cold_first = _turn(writer, first_prompt, args.max_tokens)
    writer.prefix_disk.flush()
    second_prompt = first_prompt + reply + first_prompt[1:40]
    restarted = make(target, drafter, prefix_cache_disk_mb=4096)
    replies, row = {}, {"prompt": len(second_prompt)}
    replies["disk"], row["ttft_disk"], row["cached"] = _turn(restarted, second_prompt,
                                                             args.max_tokens, cached=True)
    replies["ram"], row["ttft_ram"] = _turn(restarted, second_prompt, args.max_tokens)
    restarted.close()
    preloaded = make(target, drafter, prefix_cache_disk_mb=4096)
    start = time.perf_counter()
    preloaded.preload_prefix_cache()
    row["preload"] = time.perf_counter() - start
    replies["preloaded"], row["ttft_preloaded"] = _turn(preloaded, second_prompt, args.max_tokens)
    replies["cold"], row["ttft_cold"] = _turn(make(target, drafter, prefix_cache=False),
                                              second_prompt, args.max_tokens)
    identical = all(reply == replies["cold"] for reply in replies.values())
    row.update(disk_ratio=row["ttft_disk"] / row["ttft_cold"],
               ram_ratio=row["ttft_ram"] / row["ttft_cold"], identical="yes" if identical else "NO")
    print(f"engine {args.engine}: first turn {len(first_prompt)} tokens (cold first token "
          f"{cold_first:.2f} s); second turn: " + ", ".join(f"{key} {value:.3f}" if
                                                           isinstance(value, float) else
                                                           f"{key} {value}"
                                                           for key, value in row.items()))
    if args.record:
        _record(args, row)
    return 0 if identical else 1


COLUMNS = [("prompt", "prompt tokens", 0), ("cached", "cached tokens", 0),
           ("ttft_cold", "ttft cold (s)", 2), ("ttft_disk", "ttft from disk (s)", 2),
           ("disk_ratio", "disk / cold", 3), ("ttft_ram", "ttft from RAM (s)", 2),
           ("ram_ratio", "RAM / cold", 3), ("preload", "preload at load (s)", 2),
           ("ttft_preloaded", "ttft preloaded (s)", 2), ("identical", "identical", 0)]


def _record(args: argparse.Namespace, row: dict) -> None:
    """Put this engine's row (rounded) into the record at `args.record`, made if absent."""
    import datetime
    import json

    from dflash_local.bench.report import write_record

    record = json.loads(args.record.read_text()) if args.record.exists() else {
        "title": "The prefix cache's disk tier: the next turn's first token after a restart",
        "measured": __doc__.split("\n\n")[2].replace("\n", " ").strip(),
        "command": [], "dataset": f"this script's own text as a ~{args.tokens}-token system "
                                  f"prompt, then the reply and a short next message",
        "settings": {"pair": "embedded (SmolLM2-135M-Instruct + smollm2-135m-dflash)",
                     "dtype": "float32", "temperature": 0, "block_size": 8,
                     "max_tokens": args.max_tokens, "disk_budget": "4096 MiB"},
        "row_header": "second turn", "source": "scripts/prefix_disk_ttft.py", "rows": [],
        "columns": [{"key": key, "label": label, "decimals": decimals}
                    for key, label, decimals in COLUMNS]}
    label = {"mlx": "MLX", "transformers": "Transformers"}[args.engine]
    command = (f"nice scripts/prefix_disk_ttft.py --engine {args.engine} --tokens {args.tokens} "
               f"--record {args.record}")
    record["rows"] = [r for r in record["rows"] if r["label"] != label] + [
        {"label": label, **{key: round(value, 3) if isinstance(value, float) else value
                            for key, value in row.items()}}]
    record["command"] = sorted({*record["command"], command})
    record["engine"] = ", ".join(r["label"] for r in record["rows"])
    record["date"] = datetime.date.today().isoformat()
    write_record(args.record, record, setting="a virtual machine")


def _embedded_pair() -> tuple[Path, Path]:
    from dflash_local.pairs.default_pair import EMBEDDED_DRAFTER_DIR, embedded_target
    from dflash_local.paths import shipped_models_dir

    return embedded_target(), shipped_models_dir() / EMBEDDED_DRAFTER_DIR


def _engine_class(name: str):
    from dflash_local.engines import engine_class_for  # MLX: our BLAS installed before it loads

    return engine_class_for(name)


def _prompt(engine, tokens: int) -> list[int]:
    """A chat prompt of about `tokens` tokens (a long system message, one question)."""
    text = Path(__file__).read_text()
    system = (text * (tokens // max(1, len(engine.encode_raw(text))) + 1))
    ids = engine.encode_chat([{"role": "system", "content": system},
                              {"role": "user", "content": "Summarize this file."}])
    return ids[:tokens]


def _turn(engine, prompt_ids: list[int], max_tokens: int, cached: bool = False) -> tuple:
    """(reply ids, seconds from the request to the first token[, cached tokens]), greedy,
    block size 8."""
    from dflash_local.events import GenerationParams, GenerationStats, parse_block_size

    params = GenerationParams(max_tokens=max_tokens, block_size=parse_block_size(8),
                              temperature=0.0)
    start, first, tokens, stats = time.perf_counter(), None, [], GenerationStats()
    for event in engine.stream(prompt_ids, params):
        first = first if first is not None else time.perf_counter() - start
        tokens.extend(event.token_ids)
        stats.add(event)
    return (tokens, first, stats.cached_tokens) if cached else (tokens, first)


if __name__ == "__main__":
    raise SystemExit(main())
