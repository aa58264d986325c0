"""A newcomer's time to first token while 3 other clients stream, with one generation at a time
(--max-batch 1) against rounds taken in turn (--max-batch 4), in one run on the real service;
every reply compared token for token with the same request alone. Not run in CI (minutes).

    .venv/bin/python scripts/batch_ttft.py --engine transformers --record docs/records/batch-ttft.json

A newcomer is a short request (a chat title, as Claude Code's haiku slot asks); the streams are
long greedy replies. Times are wall clock from the request to the first chunk with a token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

STREAM_PROMPTS = ["Tell me a long story about a lighthouse keeper.",
                  "Explain how a bicycle works, in detail.",
                  "Write a long letter to a friend about your garden."]
NEWCOMER = "Write a five-word title for a chat about gardening."
SETTINGS = {"temperature": 0, "block_size": "auto (the service's default)"}
SETTLE_S = 3.0  # after the worker's last job, for its next-turn warm-ups, before an idle newcomer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["mlx", "transformers"], default="transformers")
    parser.add_argument("--stream-tokens", type=int, default=160, help="each stream's max_tokens")
    parser.add_argument("--newcomer-tokens", type=int, default=12)
    parser.add_argument("--tries", type=int, default=3, help="newcomers per setting (median)")
    parser.add_argument("--record", type=Path, help="write the JSON record here")
    parser.add_argument("--long-join", type=int, metavar="TOKENS",
                        help="instead: a prompt of about TOKENS tokens joins 3 streams (--max-batch "
                             "4); the longest gap in their chunks while it prefills, against one "
                             "prefill chunk's time")
    args = parser.parse_args()
    if args.long_join:
        from batch_long_join import measure_long_join

        return measure_long_join(args, _service, _reply)
    results = {batch: measure(args, batch) for batch in (1, 4)}
    identical = all(r["identical"] for r in results.values())
    streams_same = results[1]["stream_ids"] == results[4]["stream_ids"]
    for batch, r in results.items():
        print(f"--max-batch {batch}: newcomer TTFT idle {r['idle_s']:.2f} s, beside 3 streams "
              f"{r['busy_s']:.2f} s ({r['busy_s'] / r['idle_s']:.1f}x idle); replies identical "
              f"to each alone: {r['identical']}")
    print(f"streams' replies the same under both settings: {streams_same}")
    if args.record:
        record_results(args, results, identical and streams_same)
    return 0 if identical and streams_same else 1


def measure(args, max_batch: int) -> dict:
    """The newcomer's TTFT alone and beside 3 streams (medians of `tries`) on a fresh service."""
    from dflash_local.service.server import BackgroundServer

    state, app = _service(args.engine, max_batch)
    server = BackgroundServer(app).start()
    try:
        url = server.url + "/v1/chat/completions"
        alone = {prompt: _reply(url, prompt, args.stream_tokens)[0] for prompt in STREAM_PROMPTS}
        newcomer_alone, _ = _reply(url, NEWCOMER, args.newcomer_tokens)
        idle, busy, identical = [], [], True
        for _ in range(args.tries):
            _settle(url)
            idle.append(_reply(url, NEWCOMER, args.newcomer_tokens)[1])
            ids, ttft, stream_ids = _beside_streams(url, args)
            busy.append(ttft)
            identical &= ids == newcomer_alone and stream_ids == [alone[p] for p in STREAM_PROMPTS]
        return {"idle_s": statistics.median(idle), "busy_s": statistics.median(busy),
                "identical": identical, "stream_ids": stream_ids,
                "engine_max_batch": state.loaded.worker.max_batch}
    finally:
        server.stop()
        state.unload()


def _service(engine: str, max_batch: int):
    from dflash_local.service.app import create_app
    from dflash_local.service.state import ServiceState

    state = ServiceState(max_batch=max_batch, adapt=False)
    state.load_pair("embedded", engine)
    return state, create_app(state)


def _settle(url: str) -> None:
    """Until the worker holds no job, then SETTLE_S more: the finished replies' next turns are
    warmed while it is idle (turn_warmup.py), and an idle newcomer timed during those warm-ups
    waits for them."""
    import httpx

    status_url = url.removesuffix("/v1/chat/completions") + "/dflash/status"
    while httpx.get(status_url).json()["worker"]["busy"]:
        time.sleep(0.05)
    time.sleep(SETTLE_S)


def _beside_streams(url: str, args) -> tuple[list[int], float, list[list[int]]]:
    """3 streams sent; once the worker holds all 3 and those running have their first token,
    the newcomer's request (with --max-batch 1 two of them wait in the queue, as clients do)."""
    import httpx

    status_url = url.removesuffix("/v1/chat/completions") + "/dflash/status"
    with ThreadPoolExecutor(len(STREAM_PROMPTS)) as pool:
        streams = [pool.submit(_reply, url, prompt, args.stream_tokens) for prompt in STREAM_PROMPTS]
        while True:
            worker = httpx.get(status_url).json()["worker"]
            if (len(worker["running"]) + worker["queued"] == len(STREAM_PROMPTS)
                    and all(job["rounds"] > 0 for job in worker["running"])):
                break
            time.sleep(0.01)
        ids, ttft = _reply(url, NEWCOMER, args.newcomer_tokens)
        return ids, ttft, [stream.result()[0] for stream in streams]


def _reply(url: str, prompt: str, max_tokens: int) -> tuple[list[int], float]:
    """(the reply's ids, seconds to its first token)."""
    import httpx

    body = {"model": "embedded", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    ids, ttft, start = [], None, time.perf_counter()
    with httpx.stream("POST", url, json=body, timeout=600) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                ids += chunk["dflash"]["token_ids"]
                if ttft is None:
                    ttft = time.perf_counter() - start
    return ids, ttft


def record_results(args, results: dict, identical: bool) -> None:
    from dflash_local.bench.report import write_record

    rows = [{"label": f"--max-batch {batch}", "idle_s": round(r["idle_s"], 3),
             "busy_s": round(r["busy_s"], 3), "ratio": round(r["busy_s"] / r["idle_s"], 2),
             "identical": "yes" if r["identical"] else "no"} for batch, r in results.items()]
    record = {
        "title": "A newcomer's time to first token while 3 clients stream",
        "compares": "one generation at a time against rounds taken in turn (--max-batch 1 vs 4): "
                    "a short request's time to first token beside 3 streams",
        "measured": "A short request's wall time to its first token, alone and once 3 long "
                    "greedy streams are running (with --max-batch 1 two of them wait in the "
                    "queue); every reply compared token for token with the same request alone.",
        "dataset": f"3 stream prompts ({args.stream_tokens} tokens each) and one title request "
                   f"({args.newcomer_tokens} tokens)",
        "date": time.strftime("%Y-%m-%d"),
        "engine": args.engine,
        "settings": {**SETTINGS, "pair": "embedded", "tries": args.tries},
        "command": f"scripts/batch_ttft.py --engine {args.engine} --stream-tokens "
                   f"{args.stream_tokens} --tries {args.tries} --record {args.record}",
        "source": "scripts/batch_ttft.py, dflash_local/service/scheduler.py, dflash_local/service/lanes.py",
        "row_header": "worker",
        "columns": [{"key": "idle_s", "label": "TTFT idle (s)", "decimals": 2},
                    {"key": "busy_s", "label": "TTFT beside 3 streams (s)", "decimals": 2},
                    {"key": "ratio", "label": "× idle", "decimals": 1},
                    {"key": "identical", "label": "replies identical to alone"}],
        "rows": rows,
        "notes": [(f"Medians of {args.tries} newcomers. With --max-batch 4 the streams are lanes "
                   f"whose proposals and verifies run batched; a newcomer joins mid-tick, after "
                   f"the proposal batch, so it waits for one batch of the others and its own "
                   f"prefill. Each idle newcomer is sent once the worker holds no job and "
                   f"{SETTLE_S:.0f} s more (the next turns' warm-ups).")],
    }
    write_record(args.record, record)


if __name__ == "__main__":
    raise SystemExit(main())
