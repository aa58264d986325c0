"""`dflash-local adapt status|reset|export`: the replies recorded for the drafter's adaptation
(adapt/store.py), per pair. Imports no engine; the store's file is read where it lies.

A reset is safe while a service records: both go through SQLite's lock, the service's next
reply simply starts the pair's rows again.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import closing
from pathlib import Path

from dflash_local.adapt.store import MIB, ReplyStore, store_path
from dflash_local.adapt.versions import VersionStore, reset_versions
from dflash_local.cli.cache import age
from dflash_local.errors import InvalidRequestError


def add_parser(commands) -> None:
    adapt = commands.add_parser(
        "adapt", help="the replies recorded for the drafter's adaptation",
        description="Finished replies of local pairs are kept under the data dir (prompt and "
                    "reply token ids, per pair; never sent anywhere) so the drafter can learn "
                    "this machine's traffic. serve --no-adapt turns recording off.")
    actions = adapt.add_subparsers(dest="action", required=True, metavar="ACTION")
    status = actions.add_parser("status", help="replies, tokens, bytes and the adapted drafter, "
                                               "per pair")
    status.add_argument("--json", action="store_true",
                        help="one JSON object per pair: /dflash/status's adapt fields")
    status.set_defaults(handler=run_status)
    reset = actions.add_parser("reset", help="delete the recorded replies and the adapted drafters "
                                             "(every pair's, or one): the shipped drafter serves")
    reset.add_argument("--pair", metavar="KEY", help="only this pair's (its key from status)")
    reset.set_defaults(handler=run_reset)
    export = actions.add_parser("export", help="write the recorded replies as JSON lines")
    export.add_argument("--pair", metavar="KEY", help="only this pair's (its key from status)")
    export.add_argument("--out", metavar="PATH", type=Path, help="the file to write (default: stdout)")
    export.set_defaults(handler=run_export)


def _open() -> ReplyStore | None:
    """The store if one was recorded (a status or export never creates it)."""
    path = store_path()
    if not path.exists():
        print(f"{path}: no replies recorded", file=sys.stderr)
        return None
    store = ReplyStore(path)
    if store.set_aside is not None:
        print(f"{path} could not be read: set aside as {store.set_aside.name}", file=sys.stderr)
    return store


def _known_pair(store: ReplyStore, key: str | None) -> None:
    if key is not None and key not in {pair.key for pair in store.pairs()}:
        raise InvalidRequestError(f"--pair {key!r}: no replies recorded for that pair (its key "
                                  f"is the first column of dflash-local adapt status)")


def run_status(args: argparse.Namespace) -> int:
    store = _open()
    if store is None:
        return 0
    with closing(store):
        pairs = store.summary()
        total = sum(pair["bytes"] for pair in pairs)
        on_disk = sum(path.stat().st_size for path in store.path.parent.glob(store.path.name + "*"))
        print(f"{store.path}: {sum(pair['replies'] for pair in pairs)} replies, "
              f"{total / MIB:.1f} MiB of ids, {on_disk / MIB:.1f} MiB on disk "
              f"(budget {store.max_replies} replies, {store.max_bytes / MIB:.0f} MiB)")
        identities = {pair.key: pair.identity for pair in store.pairs()}
        for pair in pairs:
            versions = VersionStore(pair["pair"], identities[pair["pair"]]["target"])
            adapt = versions.offline_status(pair["replies"],
                                            store.count(pair["pair"], versions.taken_through()))
            if args.json:
                print(json.dumps({"pair": pair["pair"], "adapt": adapt}))
                continue
            print(f"{pair['pair']}  {pair['target']} + {pair['drafter'] or 'no drafter'}  "
                  f"{pair['replies']} replies  {pair['prompt_tokens']} prompt + "
                  f"{pair['reply_tokens']} reply tokens  {pair['bytes'] / MIB:.2f} MiB  "
                  f"newest {age(pair['newest'])} ago")
            _print_adapted(adapt)
    return 0


def _print_adapted(adapt: dict) -> None:
    serving = f"adapted v{adapt['version']}" if adapt["version"] else "the shipped drafter"
    print(f"    drafter: {serving} serves; {adapt['trained_on']} replies taken in, "
          f"{adapt['pending']} pending")
    for entry in adapt["history"]:
        print(f"    v{entry['version']}  {entry['at']}  trained on {entry['trained_on']} replies  "
              f"tau on recent replies {entry['tau_before']:.2f} -> {entry['tau_after']:.2f}")


def run_reset(args: argparse.Namespace) -> int:
    store = _open()
    if store is None:
        return 0
    with closing(store):
        _known_pair(store, args.pair)
        deleted = store.reset(args.pair)
    versions = reset_versions(args.pair)
    print(f"{store.path}: {deleted} replies deleted, {versions} adapted drafter versions deleted "
          f"(the shipped drafter serves)")
    return 0


def run_export(args: argparse.Namespace) -> int:
    store = _open()
    if store is None:
        return 0
    with closing(store):
        _known_pair(store, args.pair)
        names = {pair.key: pair for pair in store.pairs()}
        out = args.out.open("w") if args.out else sys.stdout
        count = 0
        try:
            for reply in store.all_replies(args.pair):
                pair = names.get(reply.pair_key)
                out.write(json.dumps({
                    "pair": reply.pair_key, "target": pair.target if pair else None,
                    "drafter": pair.drafter if pair else None,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(reply.created)),
                    "prompt_ids": reply.prompt_ids, "reply_ids": reply.reply_ids,
                    "meta": reply.meta}) + "\n")
                count += 1
        finally:
            if args.out:
                out.close()
    print(f"{count} replies exported" + (f" to {args.out}" if args.out else ""), file=sys.stderr)
    return 0
