"""A long prompt joining 3 running streams (--max-batch 4): the longest gap between two chunks of
any running stream while it prefills, against one prefill chunk's time (the same prompt's
prefill alone over its chunks) and the streams' own gap before it joined (a round of 3).
Run through scripts/batch_ttft.py; not run in CI (minutes).

    .venv/bin/python scripts/batch_ttft.py --long-join 6000 --record docs/records/batch-long-join.json

Each prompt starts with its own tag, so no run finds another's rows in the prefix cache.
"""

from __future__ import annotations

import itertools
import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

STREAM_PROMPTS = ["Tell me a long story about a lighthouse keeper.",
                  "Explain how a bicycle works, in detail.",
                  "Write a long letter to a friend about your garden."]
STREAM_TOKENS = 4000  # the streams outlast the join; they are closed once it has its first token
FILLER = "The river bends past the old mill, and the town listens to the water at night. "


def measure_long_join(args, service, reply) -> int:
    from dflash_local.method.shared_rounds import PREFILL_CHUNK_ROWS
    from dflash_local.service.server import BackgroundServer

    state, app = service(args.engine, 4)
    server = BackgroundServer(app).start()
    try:
        url = server.url + "/v1/chat/completions"
        prompt_tokens = len(state.loaded.engine.encode_chat(_messages(_long_prompt(args.long_join, 0))))
        chunks = -(-prompt_tokens // PREFILL_CHUNK_ROWS)
        alone_s = statistics.median(reply(url, _long_prompt(args.long_join, run), 1)[1]
                                    for run in (1, 2))
        gaps = _gaps_while_joining(url, _long_prompt(args.long_join, 3))
    finally:
        server.stop()
        state.unload()
    figures = {"prompt_tokens": prompt_tokens, "chunks": chunks, "chunk_rows": PREFILL_CHUNK_ROWS,
               "prefill_alone_s": round(alone_s, 3), "chunk_s": round(alone_s / chunks, 3), **gaps,
               "chunk_in_join_s": round(gaps["join_ttft_s"] / chunks, 3)}
    print(json.dumps(figures))
    if args.record:
        _write(args, figures)
    return 0


def _long_prompt(tokens: int, run: int) -> str:
    """About `tokens` tokens (the filler is about 18 a sentence), tagged by `run`."""
    return f"(run {run}) Summarize this in one line. " + FILLER * (tokens // 18)


def _messages(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def _gaps_while_joining(url: str, prompt: str) -> dict:
    """3 streams running, then the long prompt sent: the longest gap between two chunks of a
    stream from its sending to its first token, and the streams' median gap before."""
    import httpx

    arrivals: list[list[float]] = [[] for _ in STREAM_PROMPTS]
    done = threading.Event()

    def stream(index: int) -> None:
        body = {"messages": _messages(STREAM_PROMPTS[index]), "max_tokens": STREAM_TOKENS,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", url, json=body, timeout=600) as response:
            for line in response.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                    arrivals[index].append(time.perf_counter())
                if done.is_set():
                    return  # closing the connection cancels it

    with ThreadPoolExecutor(len(STREAM_PROMPTS)) as pool:
        running = [pool.submit(stream, index) for index in range(len(STREAM_PROMPTS))]
        while min(len(times) for times in arrivals) < 10:  # each past its prefill, rounds running
            time.sleep(0.05)
        sent = time.perf_counter()
        body = {"messages": _messages(prompt), "max_tokens": 1, "temperature": 0, "stream": True}
        with httpx.stream("POST", url, json=body, timeout=600) as response:
            first = next(time.perf_counter() for line in response.iter_lines()
                         if line.startswith("data: {") and json.loads(line[6:]).get("choices"))
        done.set()
        for future in running:
            future.result()
    during = [b - a for times in arrivals for a, b in itertools.pairwise(times) if sent < b <= first]
    before = [b - a for times in arrivals for a, b in itertools.pairwise(times) if b <= sent]
    return {"join_ttft_s": round(first - sent, 3), "longest_gap_s": round(max(during), 3),
            "median_gap_before_s": round(statistics.median(before), 3),
            "stream_chunks_during": len(during)}


def _write(args, figures: dict) -> None:
    from dflash_local.bench.report import write_record

    row = {"label": f"{figures['prompt_tokens']}-token prompt joins 3 streams", **figures}
    columns = [("prompt_tokens", "prompt tokens", 0), ("chunks", "chunks", 0),
               ("chunk_s", "one chunk alone (s)", 2), ("median_gap_before_s", "streams' gap before (s)", 2),
               ("longest_gap_s", "longest gap while it prefills (s)", 2),
               ("join_ttft_s", "its first token (s)", 2),
               ("chunk_in_join_s", "its first token over its chunks (s)", 2)]
    write_record(args.record, {
        "title": "A long prompt joining running streams",
        "compares": "the running streams' longest gap while a long prompt prefills beside them, "
                    "against one prefill chunk's time",
        "measured": "3 greedy streams run (--max-batch 4); a long prompt joins. The longest gap "
                    "between two chunks of any stream from its sending to its first token, the "
                    "streams' median gap before it, and one chunk's time: the same prompt's "
                    "prefill alone over its chunks (the mean; later chunks attend to more rows).",
        "dataset": f"a filler text of {figures['prompt_tokens']} tokens; 3 chat prompts",
        "date": time.strftime("%Y-%m-%d"),
        "engine": args.engine,
        "settings": {"temperature": 0, "pair": "embedded", "chunk_rows": figures["chunk_rows"]},
        "command": f"scripts/batch_ttft.py --engine {args.engine} --long-join {args.long_join} "
                   f"--record {args.record}",
        "source": "scripts/batch_long_join.py, dflash_local/service/lanes.py",
        "row_header": "run",
        "columns": [{"key": key, "label": label, "decimals": decimals}
                    for key, label, decimals in columns],
        "rows": [row],
        "notes": [("One chunk's time is given twice: the prompt's prefill alone over its chunks, "
                  "and its first token beside the streams over its chunks (a chunk and a round "
                  "of the streams each). On a shared machine the two runs may see different "
                  "loads; compare the longest gap with the second, measured in the same minutes.")],
    })
