"""Many clients at once on the real service: aggregate and per-request tokens/s and time to first
token at each concurrency, speculative against plain, on one local engine; every reply compared
token for token with the same request alone. Not run in CI (minutes).

    .venv/bin/python scripts/bench_concurrency.py --engine transformers --concurrency 1,2,4,8 \
        --record docs/records/concurrency-transformers.json

N clients stream greedy replies to N prompts (held-out and chat prompts of bench/datasets.py, in
turn), arriving `--stagger` seconds apart; the service keeps max(N) generations in flight
(service/lanes.py), so none waits in the queue. At each concurrency the speculative and the plain
run follow each other, so a change of the machine's load falls on both. Aggregate tokens/s: every
reply's tokens over the wall time from the first request to the last reply's end; per request:
its tokens after the first over the time from its first token to its end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODES = {"speculative": True, "plain": False}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["mlx", "transformers"], default="transformers")
    parser.add_argument("--concurrency", default="1,2,4,8", help="comma-separated client counts")
    parser.add_argument("--tokens", type=int, default=64, help="each reply's max_tokens")
    parser.add_argument("--stagger", type=float, default=0.1, help="seconds between arrivals")
    parser.add_argument("--record", type=Path, help="write the JSON record here")
    args = parser.parse_args()
    levels = [int(level) for level in args.concurrency.split(",")]
    prompts = _prompts(max(levels))
    state, server = _service(args.engine, max(levels))
    try:
        url = server.url + "/v1/chat/completions"
        alone = {(mode, p): _reply(url, p, args.tokens, on, time.perf_counter())["ids"]
                 for mode, on in MODES.items() for p in prompts}
        rows = [_level(url, prompts[:level], args, alone) for level in levels]
        worker = state.loaded.worker.status()
        batching = _batching(state.loaded.engine, worker)
    finally:
        server.stop()
        state.unload()
    for row in rows:
        print(json.dumps(row))
    print(batching)
    if args.record:
        _write_record(args, rows, batching, len(prompts))
    return 0 if all(row["identical"] == "yes" for row in rows) else 1


def _prompts(count: int) -> list[str]:
    """Held-out and chat prompts in turn, `count` of them."""
    from dflash_local.bench.datasets import chat_prompts, embedded_prompts

    held_out, chat = embedded_prompts(count), chat_prompts(count)
    mixed = [p for pair in zip(held_out, chat, strict=False) for p in pair][:count]
    return [prompt.turns[0] for prompt in mixed]


def _service(engine: str, max_batch: int):
    from dflash_local.service.app import create_app
    from dflash_local.service.server import BackgroundServer
    from dflash_local.service.state import ServiceState

    state = ServiceState(max_batch=max_batch)
    state.load_pair("embedded", engine)
    return state, BackgroundServer(create_app(state)).start()


def _level(url: str, prompts: list[str], args, alone: dict) -> dict:
    """One concurrency: the speculative run, then the plain one."""
    row: dict = {"label": f"{len(prompts)} client{'s' if len(prompts) > 1 else ''}"}
    same = True
    for mode, on in MODES.items():
        replies = _together(url, prompts, args, on)
        same &= all(r["ids"] == alone[(mode, p)] for r, p in zip(replies, prompts, strict=True))
        start = min(r["sent"] for r in replies)
        tokens = sum(len(r["ids"]) for r in replies)
        row[f"{mode}_aggregate"] = round(tokens / (max(r["end"] for r in replies) - start), 1)
        row[f"{mode}_per_request"] = round(statistics.median(
            (len(r["ids"]) - 1) / (r["end"] - r["first"]) for r in replies), 1)
        row[f"{mode}_ttft"] = round(statistics.median(r["first"] - r["sent"] for r in replies), 3)
    row["speedup"] = round(row["speculative_aggregate"] / row["plain_aggregate"], 2)
    row["identical"] = "yes" if same else "no"
    return row


def _together(url: str, prompts: list[str], args, speculative: bool) -> list[dict]:
    """Every prompt's reply, client i arriving i * stagger seconds after the first."""
    begin = time.perf_counter() + 0.05
    gate = threading.Barrier(len(prompts))

    def client(index: int) -> dict:
        gate.wait()
        time.sleep(max(0.0, begin + index * args.stagger - time.perf_counter()))
        return _reply(url, prompts[index], args.tokens, speculative, time.perf_counter())

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(client, range(len(prompts))))


def _reply(url: str, prompt: str, max_tokens: int, speculative: bool, sent: float) -> dict:
    """The reply's ids and when it was sent, got its first token and ended (perf_counter)."""
    import httpx

    body = {"model": "embedded", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "speculative": speculative}
    ids, first = [], None
    with httpx.stream("POST", url, json=body, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and (chunk := json.loads(line[6:])).get("choices"):
                ids += chunk["dflash"]["token_ids"]
                first = first or (time.perf_counter() if ids else None)
    return {"ids": ids, "sent": sent, "first": first, "end": time.perf_counter()}


def _batching(engine, worker: dict) -> str:
    """How the lanes' verifies and drafter calls ran: batched by the class, or one after another."""
    runner_class = type(engine.make_runner(collect_taps=False))
    drafter = engine.make_drafter()
    how = ("one batched forward (the runner's verify_batch)" if hasattr(runner_class, "verify_batch")
           else "one verify after another (no verify_batch on the runner yet)")
    drafts = ("one drafter pass (the drafter's propose_batch / propose_tree_batch)"
              if drafter is not None and hasattr(type(drafter), "propose_batch")
              else "one drafter call after another")
    verifies = worker["verifies"] / max(1, worker["verify_batches"])
    proposals = worker["proposals"] / max(1, worker["proposal_batches"])
    return (f"verifies of a tick ran as {how}, {verifies:.2f} lanes' verifies per tick on "
            f"average; drafter calls of a tick as {drafts}, {proposals:.2f} lanes' calls per "
            f"batch on average")


def _write_record(args, rows: list[dict], batching: str, prompt_count: int) -> None:
    def column(key: str, label: str, decimals: int | None = 1) -> dict:
        return {"key": key, "label": label, **({"decimals": decimals} if decimals is not None else {})}

    record = {
        "title": f"Many clients at once: tokens/s and time to first token ({args.engine})",
        "compares": "speculative against plain at 1, 2, 4 and 8 concurrent clients, through the "
                    "worker's lanes",
        "measured": __doc__.split("\n\n")[2].replace("\n", " ").strip(),
        "dataset": f"{prompt_count} prompts: embedded held-out and chat in turn; "
                   f"{args.tokens} tokens each",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()}-core {platform.processor() or platform.machine()}",
        "engine": args.engine,
        "settings": {"temperature": 0, "block_size": "auto (the service's default)",
                     "pair": "embedded", "stagger_s": args.stagger, "verify": batching},
        "command": f"scripts/bench_concurrency.py --engine {args.engine} --concurrency "
                   f"{args.concurrency} --tokens {args.tokens} --record {args.record}",
        "source": "scripts/bench_concurrency.py, dflash_local/service/lanes.py",
        "row_header": "clients",
        "columns": [column("speculative_aggregate", "spec aggregate tok/s"),
                    column("plain_aggregate", "plain aggregate tok/s"),
                    column("speedup", "spec ÷ plain", 2),
                    column("speculative_per_request", "spec per-request tok/s"),
                    column("plain_per_request", "plain per-request tok/s"),
                    column("speculative_ttft", "spec TTFT (s)", 2),
                    column("plain_ttft", "plain TTFT (s)", 2),
                    column("identical", "replies identical to alone", None)],
        "rows": rows,
        "notes": [f"Lanes: {batching}.",
                  ("The 2 cores are shared with other jobs: figures of one run compare with "
                   "each other, not with another run's.")],
    }
    args.record.write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
