"""A drafter's draft vocabulary: the token ids its proposals are drawn from. Framework-free.

A drafter borrows the target's LM head, and on a CPU that head is most of a draft pass (the
embedded pair: 49,152 rows, ~0.2 of a target step, against ~0.05 for the two draft layers). A
target's own outputs use few of those rows (9,072 distinct ids in the first 748k response tokens
SmolLM2 regenerated for its drafter; the 8,192 most frequent of all 909k cover 99.86%), so the
drafter scores only those. Proposals stay exact-verified: a token outside the set is never
proposed, the target takes it at the round's bonus position, the output does not change.

The set lives beside the checkpoint as `draft_vocab.json` (written by our trainer from the
regenerated data); z-lab's own loaders ignore the file, and a drafter without one uses the full
head.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from dflash_local.errors import CheckpointError

FILE_NAME = "draft_vocab.json"
DEFAULT_SIZE = 8192


def choose_draft_vocab(token_counts: Counter, size: int = DEFAULT_SIZE) -> list[int]:
    """The `size` most frequent ids (ties: the lower id), ascending."""
    ranked = sorted(token_counts.items(), key=lambda item: (-item[1], item[0]))
    return sorted(token_id for token_id, _count in ranked[:size])


def count_tokens(sequences: Iterable[Iterable[int]]) -> Counter:
    counts: Counter = Counter()
    for token_ids in sequences:
        counts.update(int(t) for t in token_ids)
    return counts


def count_response_tokens(sequences: Iterable[dict]) -> Counter:
    """Counts over the responses of regenerated sequences (train/regenerate.py's records)."""
    return count_tokens(s["tokens"][s["prompt_len"]:].tolist() for s in sequences)


def write_draft_vocab(out_dir: str | Path, token_ids: list[int], counts: Counter) -> Path:
    """Atomic write, with the share of the counted tokens the set covers (for the model card)."""
    total = sum(counts.values())
    covered = sum(counts[t] for t in token_ids)
    record = {
        "token_ids": sorted(int(t) for t in token_ids),
        "counted_tokens": total,
        "coverage": round(covered / total, 4) if total else None,
    }
    path = Path(out_dir) / FILE_NAME
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, path)
    return path


def load_draft_vocab(drafter_dir: str | Path | None, vocab_size: int) -> list[int] | None:
    """The drafter's draft vocabulary (ascending ids), None when it has none."""
    if drafter_dir is None:
        return None
    path = Path(drafter_dir) / FILE_NAME
    if not path.is_file():
        return None
    try:
        token_ids = json.loads(path.read_text())["token_ids"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} is not a draft vocabulary ({type(exc).__name__}: {exc})") from None
    if not isinstance(token_ids, list) or not token_ids or not all(type(t) is int for t in token_ids):
        raise CheckpointError(f"{path}: token_ids must be a non-empty list of integers")
    if len(set(token_ids)) != len(token_ids):
        raise CheckpointError(f"{path}: token_ids has duplicates")
    out_of_range = [t for t in token_ids if not 0 <= t < vocab_size]
    if out_of_range:
        raise CheckpointError(
            f"{path}: token ids {out_of_range[:5]} are outside the target's vocabulary of {vocab_size}"
        )
    return sorted(token_ids)
