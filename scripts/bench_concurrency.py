"""The command of the concurrency records written before `dflash-local bench --concurrency`
(dflash_local/bench/concurrency.py measures): the same run, its flags passed on.

    .venv/bin/python scripts/bench_concurrency.py --engine transformers --concurrency 1,2,4,8 \
        --tokens 32 --record docs/records/concurrency-transformers.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    from dflash_local.cli.main import main as cli_main

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["mlx", "transformers"], default="transformers")
    parser.add_argument("--concurrency", default="1,2,4,8", help="comma-separated client counts")
    parser.add_argument("--tokens", default="64", help="each reply's max_tokens")
    parser.add_argument("--stagger", default="0.1", help="seconds between arrivals")
    parser.add_argument("--record", help="write the JSON record here")
    args = parser.parse_args()
    return cli_main(["bench", "--engine", args.engine, "--concurrency", args.concurrency,
                     "--max-tokens", args.tokens, "--stagger", args.stagger,
                     *(["--record", args.record] if args.record else [])])


if __name__ == "__main__":
    raise SystemExit(main())
