"""Write draft_vocab.json for an existing drafter from the regenerated data it was trained on.

`dflash-local train` writes it itself (`--draft-vocab N`); this is for a drafter trained before
(it counts the responses of --data's training split, as the trainer does: pass the data the
drafter was trained on).
Usage: .venv/bin/python scripts/experiments/write_draft_vocab.py --data runs/smol-regen --out models/smollm2-135m-dflash
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dflash_local.drafter.draft_vocab import (
    DEFAULT_SIZE,
    choose_draft_vocab,
    count_response_tokens,
    write_draft_vocab,
)
from dflash_local.train.trainer import load_sequences, split_validation


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="regenerated-data directory (regen-*.pt)")
    parser.add_argument("--out", type=Path, required=True, help="the drafter directory")
    parser.add_argument("--size", type=int, default=DEFAULT_SIZE)
    args = parser.parse_args()
    counts = count_response_tokens(split_validation(load_sequences(args.data))[1])
    path = write_draft_vocab(args.out, choose_draft_vocab(counts, args.size), counts)
    record = json.loads(path.read_text())
    print(f"{path}: {len(record['token_ids'])} ids, coverage {record['coverage']} of "
          f"{record['counted_tokens']} response tokens ({len(counts)} distinct)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
