"""What recording a reply costs, and why the store keeps ids and not taps. Not run in CI (a few
prefills); the embedded pair.

    .venv/bin/python scripts/adapt_taps_vs_ids.py --record docs/records/adapt-taps-vs-ids.json
    .venv/bin/python scripts/render_benchmarks.py

For exchanges of each length, the taps the drafter trains on (its target layers' outputs, in the
engine's dtype) are set against the token ids the store keeps; the store's own bytes on disk per
token are measured after recording the exchanges; "recompute" is the target's prefill over the
exchange with the prefix cache off, which yields the taps from the ids again (median of three);
"record" is one reply's write into the store (SQLite, one transaction, median of ten).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TEXT = ("The river rises in the hills, runs through three towns and meets the sea at a wide "
        "delta where the birds stop on their way south. ")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--record", type=Path, help="the JSON record this run's rows go into")
    args = parser.parse_args()
    from dflash_local.drafter.config import load_drafter_config
    from dflash_local.engines import engine_class_for
    from dflash_local.pairs.default_pair import EMBEDDED_DRAFTER_DIR, embedded_target
    from dflash_local.paths import shipped_models_dir

    drafter_dir = shipped_models_dir() / EMBEDDED_DRAFTER_DIR
    engine = engine_class_for("transformers")(embedded_target(), drafter_dir, prefix_cache=False)
    config = load_drafter_config(drafter_dir)
    os.environ["DFLASH_LOCAL_HOME"] = tempfile.mkdtemp(prefix="adapt-taps-")  # a store of its own
    taps_bytes = len(config.target_layer_ids) * config.hidden_size * 4  # float32, as served here
    rows = [_row(engine, length, taps_bytes) for length in args.lengths]
    for row in rows:
        print(json.dumps(row))
    if args.record:
        _record(args, rows)
    return 0


def _row(engine, length: int, taps_bytes: int) -> dict:
    from dflash_local.adapt.store import RecordedPair, ReplyStore, store_path
    from dflash_local.events import GenerationParams

    ids = (engine.tokenizer.encode(TEXT) * (length // 8))[:length]
    params = GenerationParams(max_tokens=1, speculative=False)
    prefills = [_prefill_s(engine, ids, params) for _ in range(3)]
    store = ReplyStore()
    store.reset()
    pair = RecordedPair("measure", "embedded", "smollm2-135m-dflash", {})
    writes = []
    for _ in range(10):
        started = time.perf_counter()
        store.add(pair, ids[: length // 2], ids[length // 2:], {})
        writes.append(time.perf_counter() - started)
    store.connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    on_disk = store_path().stat().st_size / (10 * length)
    store.close()
    recompute_s = statistics.median(prefills)
    return {"label": f"{length} tokens", "taps_per_token": taps_bytes, "ids_per_token": 4,
            "ratio": taps_bytes / 4, "disk_per_token": on_disk,
            "taps_mib": taps_bytes * length / (1 << 20), "recompute_s": recompute_s,
            "recompute_tok_s": length / recompute_s, "record_ms": statistics.median(writes) * 1000}


def _prefill_s(engine, ids: list[int], params) -> float:
    stream = engine.stream(ids, params)
    try:
        return next(stream).prefill_s  # the prefill's event: the taps of every row are computed
    finally:
        stream.close()


COLUMNS = [("taps_per_token", "taps (B/token)", 0), ("ids_per_token", "ids (B/token)", 0),
           ("ratio", "taps / ids", 0), ("disk_per_token", "store on disk (B/token)", 1),
           ("taps_mib", "taps of the exchange (MiB)", 1), ("recompute_s", "recompute (s)", 2),
           ("recompute_tok_s", "recompute (tok/s)", 0), ("record_ms", "record (ms)", 2)]


def _record(args: argparse.Namespace, rows: list[dict]) -> None:
    from dflash_local.bench.report import write_record

    record = {
        "title": "Recording replies for adaptation: ids, not taps",
        "measured": __doc__.split("\n\n")[2].replace("\n", " ").strip(),
        "command": (f"nice scripts/adapt_taps_vs_ids.py --lengths "
                    f"{' '.join(map(str, args.lengths))} --record {args.record}"),
        "date": datetime.date.today().isoformat(),
        "engine": "Transformers", "dataset": "generated: one sentence repeated to each length",
        "settings": {"pair": "embedded (SmolLM2-135M-Instruct + smollm2-135m-dflash)",
                     "dtype": "float32", "prefix_cache": "off"},
        "row_header": "exchange", "source": "scripts/adapt_taps_vs_ids.py",
        "compares": "the bytes of a recorded exchange's taps against its token ids, and the "
                    "prefill that recomputes the taps",
        "columns": [{"key": key, "label": label, "decimals": decimals}
                    for key, label, decimals in COLUMNS],
        "rows": [{key: round(value, 2) if isinstance(value, float) else value
                  for key, value in row.items()} for row in rows],
        "notes": [("A z-lab drafter of an 8B target (5 taps of 4096 values, bfloat16) needs 40 KiB "
                  "of taps per token, 10240 times its id: 200 replies of 2K tokens would be 16 GiB "
                  "of taps against 1.6 MiB of ids.")]}
    write_record(args.record, record, setting="a virtual machine, shared with other work")


if __name__ == "__main__":
    raise SystemExit(main())
