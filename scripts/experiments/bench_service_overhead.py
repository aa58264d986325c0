"""What the HTTP service costs: decode tokens/s through the SSE stream vs the engine's own.

The service runs as its own process (`dflash-local serve`), so the client here does not share a
GIL with it; the engine runs in this process on the same request (same messages, same
parameters, greedy), while the server sits idle. Runs alternate to spread the machine's drift.
Both sides measure the same thing: tokens committed after the first event, over the time from
the first event (or SSE chunk) to the last. CPU seconds per token (this process for the engine,
the server process for HTTP) are reported too: on a machine shared with other jobs, wall-clock
rates swing run to run, CPU time much less.

    .venv/bin/python scripts/experiments/bench_service_overhead.py              # the embedded target
    .venv/bin/python scripts/experiments/bench_service_overhead.py --target DIR --drafter DIR --runs 7
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `dflash-local serve` does, before torch

import httpx
import psutil

from dflash_local.events import GenerationParams

PROMPT = "Write a short story about a robot who learns to paint, in five paragraphs."
BAR = 0.95


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", help="target dir (default: the embedded SmolLM2 target)")
    parser.add_argument("--drafter", help="drafter dir (default: the shipped one, if present)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--plain", action="store_true", help="speculation off (1 token per chunk)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    return parser.parse_args()


def default_pair(args: argparse.Namespace) -> tuple[str, str | None]:
    from dflash_local.pairs.default_pair import pair_names

    return pair_names(args.target, args.drafter, speculative=not args.plain)


def decode_rate(times: list[float], counts: list[int]) -> float:
    """Tokens after the first event, per second from the first event to the last."""
    return sum(counts[1:]) / (times[-1] - times[0])


def run_engine(engine, prompt_ids: list[int], params: GenerationParams) -> tuple[float, int, float]:
    times, counts = [], []
    cpu_start = time.process_time()
    for event in engine.stream(prompt_ids, params):
        times.append(time.perf_counter())
        counts.append(len(event.token_ids))
    return decode_rate(times, counts), sum(counts), time.process_time() - cpu_start


def cpu_seconds(server: psutil.Process) -> float:
    times = server.cpu_times()
    return times.user + times.system


def run_http(client: httpx.Client, url: str, body: dict,
             server: psutil.Process) -> tuple[float, int, float]:
    times, counts = [], []
    cpu_start = cpu_seconds(server)
    with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                times.append(time.perf_counter())
                counts.append(len(chunk["dflash"]["token_ids"]))
    return decode_rate(times, counts), sum(counts), cpu_seconds(server) - cpu_start


def start_server(target: str, drafter: str | None) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "dflash_local.cli.main", "serve", "--port", "0", "--target", target]
    if drafter:
        command += ["--drafter", drafter]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    match = re.search(r"on (http://[\d.]+:\d+)", line)
    if not match:
        process.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    return process, match[1]


def main() -> int:
    args = parse_args()
    target, drafter = default_pair(args)
    speculative = drafter is not None and not args.plain
    from dflash_local.engines import load_engine

    engine = load_engine("transformers", target, drafter)
    messages = [{"role": "user", "content": PROMPT}]
    prompt_ids = engine.encode_chat(messages)
    params = GenerationParams(max_tokens=args.max_tokens, speculative=speculative)
    body = {"messages": messages, "max_tokens": args.max_tokens, "stream": True,
            "speculative": speculative, "stream_options": {"include_usage": True}}
    process, url = start_server(target, drafter)
    server = psutil.Process(process.pid)
    direct, through_http, direct_cpu, server_cpu = [], [], [], []
    try:
        with httpx.Client(timeout=None) as client:
            run_engine(engine, prompt_ids, params)  # warm-up, both sides
            run_http(client, url, body, server)
            for _ in range(args.runs):
                rate, tokens, cpu = run_engine(engine, prompt_ids, params)
                direct.append(rate)
                direct_cpu.append(cpu)
                http_rate, http_tokens, http_cpu = run_http(client, url, body, server)
                through_http.append(http_rate)
                server_cpu.append(http_cpu)
                assert tokens == http_tokens, (tokens, http_tokens)
    finally:
        process.terminate()
        process.wait(60)
    result = {
        "target": target, "drafter": drafter, "speculative": speculative,
        "max_tokens": args.max_tokens, "runs": args.runs, "tokens": tokens,
        "engine_tokens_per_s": statistics.median(direct),
        "http_tokens_per_s": statistics.median(through_http),
        "engine_cpu_ms_per_token": 1000 * statistics.median(direct_cpu) / tokens,
        "server_cpu_ms_per_token": 1000 * statistics.median(server_cpu) / tokens,
    }
    result["cpu_ratio"] = result["engine_cpu_ms_per_token"] / result["server_cpu_ms_per_token"]
    # back-to-back pairs see about the same machine load: their ratios are the robust figure
    result["ratio"] = statistics.median(h / d for h, d in zip(through_http, direct, strict=True))
    result["ratio_of_medians"] = result["http_tokens_per_s"] / result["engine_tokens_per_s"]
    print(f"engine {result['engine_tokens_per_s']:.1f} tok/s, through HTTP "
          f"{result['http_tokens_per_s']:.1f} tok/s: ratio {result['ratio']:.3f} (median of "
          f"paired runs; bar {BAR}) [{tokens} tokens, speculative={speculative}, runs={args.runs}]")
    print(f"CPU per token: engine {result['engine_cpu_ms_per_token']:.2f} ms, server "
          f"{result['server_cpu_ms_per_token']:.2f} ms: ratio {result['cpu_ratio']:.3f}")
    print("per run engine:", [round(r, 1) for r in direct])
    print("per run http:  ", [round(r, 1) for r in through_http])
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if result["ratio"] >= BAR else 1


if __name__ == "__main__":
    sys.exit(main())
