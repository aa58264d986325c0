"""`dflash-local cache list|clear`: the prefix cache's disk tier under the data dir
(method/prefix_disk.py), per pair. Imports no engine: listing reads the manifests alone.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from dflash_local.method.prefix_cache import MIB


def add_parser(commands) -> None:
    cache = commands.add_parser(
        "cache", help="the conversations' prefix cache kept on disk",
        description="Entries the local engines keep on disk between runs, per pair (serve "
                    "--prefix-cache-disk-mb bounds them).")
    actions = cache.add_subparsers(dest="action", required=True, metavar="ACTION")
    actions.add_parser("list", help="each pair's entries: tokens, size, last use").set_defaults(
        handler=run_list)
    actions.add_parser("clear", help="delete every entry (every pair's)").set_defaults(
        handler=run_clear)


def _root() -> Path:
    from dflash_local.engines.local import prefix_cache_root

    return prefix_cache_root()


def run_list(args: argparse.Namespace) -> int:
    from dflash_local.method.prefix_disk import entry_files

    root = _root()
    by_pair: dict[Path, list[tuple[Path, int]]] = {}
    for manifest, size in entry_files(root) if root.is_dir() else []:
        by_pair.setdefault(manifest.parent, []).append((manifest, size))
    total = sum(size for entries in by_pair.values() for _, size in entries)
    print(f"{root}: {sum(map(len, by_pair.values()))} entries, {total / MIB:.1f} MiB")
    for directory, entries in sorted(by_pair.items()):
        print(f"{directory.name}  {_describe_pair(directory)}")
        for manifest, size in reversed(entries):  # the latest used first
            print(f"  {_tokens(manifest):>7} tokens  {size / MIB:8.1f} MiB  "
                  f"used {age(manifest.stat().st_mtime)} ago")
    return 0


def run_clear(args: argparse.Namespace) -> int:
    from dflash_local.method.prefix_disk import clear

    root = _root()
    count = clear(root) if root.is_dir() else 0
    print(f"{root}: {count} entries deleted")
    return 0


def _describe_pair(directory: Path) -> str:
    try:
        pair = json.loads((directory / "pair.json").read_text())
    except (OSError, json.JSONDecodeError):
        return "(pair unknown)"
    names = [Path(model["path"]).name if model else "no drafter"
             for model in (pair.get("target"), pair.get("drafter"))]
    return f"{pair.get('engine')} {pair.get('dtype')}  {names[0]} + {names[1]}"


def _tokens(manifest: Path) -> str:
    try:
        return str(len(json.loads(manifest.read_bytes())["token_ids"]))
    except (OSError, ValueError, KeyError):
        return "?"


def age(mtime: float) -> str:
    """How long ago `mtime` (seconds since the epoch) was, in its largest unit: 3d, 2h, 5m, 9s."""
    seconds = max(0, int(time.time() - mtime))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"
