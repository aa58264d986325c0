"""Whether a model snapshot in the Hugging Face cache is complete, not merely present.

A download writes the snapshot's manifest (every file it fetched, with its size) only once each
file is in place at that size; a snapshot is complete when its manifest's files are all there at
their sizes. A snapshot with no manifest (fetched by another tool) is judged by its shape: a
config.json and every weight file its index names, or at least one. A partial snapshot (a
download cut off, or stopped after its config.json) is "incomplete: resume or delete".
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_local.errors import ModelNotFoundError

MANIFEST = ".dflash-manifest.json"  # hidden: loaders only read the files they know
INCOMPLETE = "incomplete: resume or delete"
WEIGHT_INDEX = "model.safetensors.index.json"


class IncompleteSnapshotError(ModelNotFoundError):
    """The snapshot exists but lacks files: loading it would fail half-way."""


def write_manifest(snapshot: Path, sizes: dict[str, int]) -> None:
    """Record the snapshot as complete, after checking each file is there at its size."""
    problems = _missing(snapshot, sizes)
    if problems:
        raise IncompleteSnapshotError(f"the download left {snapshot.name} {INCOMPLETE} "
                                      f"({'; '.join(problems[:3])})")
    (snapshot / MANIFEST).write_text(json.dumps({"files": sizes}, indent=1, sort_keys=True))


def snapshot_problems(snapshot: Path) -> list[str]:
    """What the snapshot lacks: [] when it is complete."""
    manifest = snapshot / MANIFEST
    if manifest.is_file():
        try:
            sizes = json.loads(manifest.read_text())["files"]
        except (ValueError, KeyError, TypeError):
            return [f"its manifest {MANIFEST} is unreadable"]
        return _missing(snapshot, sizes)
    return _shape_problems(snapshot)


def check_complete(snapshot: Path, name: str) -> Path:
    """The snapshot, or IncompleteSnapshotError naming the model (never the server's path)."""
    problems = snapshot_problems(snapshot)
    if problems:
        raise IncompleteSnapshotError(f"{name} is {INCOMPLETE} in the local cache "
                                      f"({'; '.join(problems[:3])})")
    return snapshot


def _missing(snapshot: Path, sizes: dict[str, int]) -> list[str]:
    problems = []
    for filename, size in sorted(sizes.items()):
        path = snapshot / filename
        if not path.is_file():
            problems.append(f"{filename} is missing")
        elif size is not None and path.stat().st_size != size:
            problems.append(f"{filename} has {path.stat().st_size} bytes, not {size}")
    return problems


def _shape_problems(snapshot: Path) -> list[str]:
    if not (snapshot / "config.json").is_file():
        return ["config.json is missing"]
    index = snapshot / WEIGHT_INDEX
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError):
            return [f"{WEIGHT_INDEX} is unreadable"]
        return [f"{shard} is missing" for shard in sorted(shards) if not (snapshot / shard).is_file()]
    if not any(snapshot.glob("*.safetensors")):
        return ["no *.safetensors weights"]
    return []
