"""Time to first token of a conversation's second turn after a restart, from the prefix cache's
disk tier, against the same prompt computed cold; outputs compared token for token. Not run in
CI (it prefills thousands of tokens); the embedded pair by default.

    .venv/bin/python scripts/prefix_disk_ttft.py --engine mlx --tokens 6000

A restart is a new engine object on the same data dir (a temporary DFLASH_LOCAL_HOME): its RAM
tier is empty, so the second turn's prefix can only come from disk. Times are wall clock from
the request to its first token (the disk read and restore included).
"""

from __future__ import annotations

import argparse
import os
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
    args = parser.parse_args()
    target, drafter = _embedded_pair()  # from the user's data dir, before the home moves
    os.environ["DFLASH_LOCAL_HOME"] = tempfile.mkdtemp(prefix="prefix-disk-ttft-")
    make = _engine_class(args.engine)
    first_prompt = _prompt(make(target, drafter, prefix_cache=False), args.tokens)
    writer = make(target, drafter, prefix_cache_disk_mb=4096)
    reply, cold_first = _turn(writer, first_prompt, args.max_tokens)
    writer.prefix_disk.flush()
    second_prompt = first_prompt + reply + first_prompt[1:40]
    restarted = make(target, drafter, prefix_cache_disk_mb=4096)
    warm_reply, warm_ttft = _turn(restarted, second_prompt, args.max_tokens)
    cold = make(target, drafter, prefix_cache=False)
    cold_reply, cold_ttft = _turn(cold, second_prompt, args.max_tokens)
    print(f"engine {args.engine}: first turn {len(first_prompt)} tokens, second turn "
          f"{len(second_prompt)} tokens; first token cold {cold_ttft:.2f} s, after a restart from "
          f"disk {warm_ttft:.2f} s ({warm_ttft / cold_ttft:.2f}x cold); outputs identical: "
          f"{warm_reply == cold_reply}; first turn's cold first token {cold_first:.2f} s")
    return 0 if warm_reply == cold_reply else 1


def _embedded_pair() -> tuple[Path, Path]:
    from dflash_local.pairs.default_pair import EMBEDDED_DRAFTER_DIR, embedded_target
    from dflash_local.paths import shipped_models_dir

    return embedded_target(), shipped_models_dir() / EMBEDDED_DRAFTER_DIR


def _engine_class(name: str):
    if name == "mlx":
        from dflash_local.engines.mlx_engine import MLXEngine

        return MLXEngine
    from dflash_local.engines.torch_engine import TorchEngine

    return TorchEngine


def _prompt(engine, tokens: int) -> list[int]:
    """A chat prompt of about `tokens` tokens (a long system message, one question)."""
    text = Path(__file__).read_text()
    system = (text * (tokens // max(1, len(engine.encode_raw(text))) + 1))
    ids = engine.encode_chat([{"role": "system", "content": system},
                              {"role": "user", "content": "Summarize this file."}])
    return ids[:tokens]


def _turn(engine, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], float]:
    """(reply ids, seconds from the request to the first token), greedy, block size 8."""
    from dflash_local.events import GenerationParams, parse_block_size

    params = GenerationParams(max_tokens=max_tokens, block_size=parse_block_size(8),
                              temperature=0.0)
    start, first, tokens = time.perf_counter(), None, []
    for event in engine.stream(prompt_ids, params):
        first = first if first is not None else time.perf_counter() - start
        tokens.extend(event.token_ids)
    return tokens, first


if __name__ == "__main__":
    raise SystemExit(main())
