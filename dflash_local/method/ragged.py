"""Ragged batches, framework-neutral: where each member's rows sit when several generations'
rows run as one sequence, and the checks every batched call (a target's `verify_batch`, a
drafter's `propose_batch` / `propose_tree_batch`, on either engine) makes of its arguments
before it touches a cache."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def spans(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """Member i's rows are [start, stop) of the joined sequence: lengths laid end to end."""
    stops = list(itertools.accumulate(lengths))
    return list(zip([0, *stops[:-1]], stops, strict=True))


def split(rows: Sequence, lengths: Sequence[int]) -> list:
    """The joined `rows` cut back into members of `lengths` (any sliceable: list, array, tensor)."""
    return [rows[start:stop] for start, stop in spans(lengths)]


def check_arguments(call: str, members: Sequence, member: str, columns: Mapping[str, Sequence],
                    owner_of: Callable[[Any], Any], owner: str) -> None:
    """Refuse a batched call whose argument lists do not pair up (one item of each column per
    member), or whose members belong to different owners (models, drafters): a ValueError that
    names the call and the counts."""
    counts = {f"{member}s": len(members), **{name: len(items) for name, items in columns.items()}}
    if len(set(counts.values())) > 1:
        got = ", ".join(f"{count} {name}" for name, count in counts.items())
        raise ValueError(f"{call} takes one of each ({', '.join(columns)}) per {member}, got {got}")
    owners = len({id(owner_of(item)) for item in members})
    if owners > 1:
        raise ValueError(f"{call} takes the {member}s of one {owner}, got {owners} {owner}s")
