"""`dflash-local bench --concurrency 1,2,4,8`: many clients at once on the real service, one
local engine. At each concurrency: aggregate and per-request tokens/s and time to first token,
speculative against plain, every reply compared token for token with the same request alone;
then the process's memory idle, during the most clients and after they drain
(bench/service_memory.py). The record goes through report.write_record (the machine named).

N clients stream greedy replies to N prompts (held-out and chat prompts of bench/datasets.py, in
turn; --dataset names others), arriving `--stagger` seconds apart; the service keeps max(N) generations in flight
(service/lanes.py), so none waits in the queue. At each concurrency the speculative and the plain
runs take turns, `--repeats` of each, so a change of the machine's load falls on both. Aggregate
tokens/s: every run's tokens over the sum of the runs' wall times, each from its first request to
its last reply's end; per request (median): its tokens after the first over the time from its
first token to its end; spec τ and mean width: the speculative runs' tokens per decoding round
and the widths their planners chose; one by one: the same prompts' replies alone (each request sent after the
last ended: the replies every level is checked against), their tokens over their summed times,
and the batch gain, a level's aggregate over that (both speculative).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dflash_local.errors import DFlashError

MODES = {"speculative": True, "plain": False}
SERVED_NAME = "bench"


@dataclass(frozen=True)
class Clients:
    """How the clients arrive and what they ask: `tokens` each reply's max_tokens."""

    url: str
    tokens: int
    stagger_s: float


def levels(text: str) -> tuple[int, ...]:
    """--concurrency's client counts: comma-separated, each >= 1."""
    try:
        counts = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--concurrency takes client counts >= 1 separated by "
                                         f"commas (e.g. 1,2,4,8), got {text!r}")
    return counts


def run(args: argparse.Namespace) -> int:
    """Serve the pair with max(levels) places, measure every level and the memory, write the
    record (--record, else OUT/concurrency-ENGINE.json); 0 when every reply equals its alone."""
    from dflash_local.bench import service_memory
    from dflash_local.bench.report import write_record

    if args.max_tokens < 1 or args.stagger < 0 or args.repeats < 1 or len(args.block_size) != 1:
        raise DFlashError(f"--concurrency needs --max-tokens >= 1, --stagger >= 0, --repeats >= 1 "
                          f"and one block size, got {args.max_tokens}, {args.stagger}, "
                          f"{args.repeats} and {','.join(map(str, args.block_size))}")
    prompts = prompt_texts(max(args.concurrency), dataset_names(args))
    state, server = serve(args, max(args.concurrency))
    try:
        clients = Clients(server.url + "/v1/chat/completions", args.max_tokens, args.stagger)
        alone = {(mode, p): reply(clients, p, on, time.perf_counter())
                 for mode, on in MODES.items() for p in prompts}
        memory = service_memory.Watch(state.loaded)
        rows = [level_row(clients, prompts[:count], alone, args.repeats,
                          memory if count == max(args.concurrency) else None)
                for count in args.concurrency]
        memory.after_drain()
        batching = batching_words(state.loaded.engine, state.loaded.worker.status())
    finally:
        server.stop()
        state.unload()
    for row in rows:
        print(json.dumps(row))
    print(batching)
    print(json.dumps(memory.figures()))
    path = args.record or args.out / f"concurrency-{args.engine}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_record(path, record(args, rows, batching, memory.figures(), len(prompts)))
    print(f"record: {path}")
    return 0 if all(row["identical"] == "yes" for row in rows) else 1


def dataset_names(args: argparse.Namespace) -> tuple[str, ...]:
    """--dataset's names (default: the held-out set and chat)."""
    return tuple(name.strip() for name in (args.dataset or "embedded,chat").split(",") if name.strip())


def prompt_texts(count: int, datasets: tuple[str, ...] = ("embedded", "chat")) -> list[str]:
    """The datasets' prompts in turn (one of each, then the next of each), `count` of them."""
    from dflash_local.bench.datasets import load_prompts

    sets = [load_prompts(name, count) for name in datasets]
    mixed = [p for turn in zip(*sets, strict=False) for p in turn][:count]
    return [prompt.turns[0] for prompt in mixed]


def serve(args: argparse.Namespace, max_batch: int):
    """The service on this machine with `max_batch` places, the pair loaded, and its server."""
    from dflash_local.pairs.default_pair import pair_names
    from dflash_local.service.app import create_app
    from dflash_local.service.server import BackgroundServer
    from dflash_local.service.state import ServiceState

    target, drafter = pair_names(args.target, args.drafter, speculative=True)
    if drafter is None:
        raise DFlashError("bench --concurrency compares speculative with plain decoding: it "
                          "needs a drafter (--drafter DIR|REPO)")
    state = ServiceState(max_batch=max_batch, adapt=False)
    state.load(args.engine, target, drafter, served_name=SERVED_NAME,
               block_size=args.block_size[0])
    return state, BackgroundServer(create_app(state)).start()


def level_row(clients: Clients, prompts: list[str], alone: dict, repeats: int = 1,
              memory=None) -> dict:
    """One concurrency: a speculative run, then a plain one, `repeats` times (`memory` watching
    them all)."""
    row: dict = {"label": f"{len(prompts)} client{'s' if len(prompts) > 1 else ''}"}
    same, runs = True, {mode: [] for mode in MODES}
    for _ in range(repeats):
        for mode, on in MODES.items():
            with memory or contextlib.nullcontext():
                replies = together(clients, prompts, on)
            same &= all(r["ids"] == alone[(mode, p)]["ids"] for r, p in zip(replies, prompts, strict=True))
            runs[mode].append(replies)
    for mode, mode_runs in runs.items():
        spans = sum(max(r["end"] for r in run) - min(r["sent"] for r in run) for run in mode_runs)
        replies = [r for run in mode_runs for r in run]
        row[f"{mode}_aggregate"] = round(sum(len(r["ids"]) for r in replies) / spans, 1)
        row[f"{mode}_per_request"] = round(statistics.median(
            (len(r["ids"]) - 1) / (r["end"] - r["first"]) for r in replies), 1)
        row[f"{mode}_ttft"] = round(statistics.median(r["first"] - r["sent"] for r in replies), 3)
    row["speedup"] = round(row["speculative_aggregate"] / row["plain_aggregate"], 2)
    rounds = [r for replies in runs["speculative"] for reply in replies for r in reply["rounds"]]
    if rounds:  # what the lanes' planners chose beside each other, and what it bought
        row["speculative_tau"] = round(statistics.fmean(tokens for tokens, _ in rounds), 2)
        row["speculative_width"] = round(statistics.fmean(width for _, width in rounds), 1)
    one_by_one = [alone[("speculative", p)] for p in prompts]
    row["speculative_one_by_one"] = round(sum(len(r["ids"]) for r in one_by_one) / sum(
        r["end"] - r["sent"] for r in one_by_one), 1)
    row["batch_gain"] = round(row["speculative_aggregate"] / row["speculative_one_by_one"], 2)
    row["identical"] = "yes" if same else "no"
    return row


def together(clients: Clients, prompts: list[str], speculative: bool) -> list[dict]:
    """Every prompt's reply, client i arriving i * stagger seconds after the first."""
    begin = time.perf_counter() + 0.05
    gate = threading.Barrier(len(prompts))

    def client(index: int) -> dict:
        gate.wait()
        time.sleep(max(0.0, begin + index * clients.stagger_s - time.perf_counter()))
        return reply(clients, prompts[index], speculative, time.perf_counter())

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(client, range(len(prompts))))


def reply(clients: Clients, prompt: str, speculative: bool, sent: float) -> dict:
    """The reply's ids and when it was sent, got its first token and ended (perf_counter)."""
    import httpx

    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": clients.tokens, "temperature": 0, "stream": True,
            "speculative": speculative}
    ids, first, rounds = [], None, []
    with httpx.stream("POST", clients.url, json=body, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and (chunk := json.loads(line[6:])).get("choices"):
                step = chunk["dflash"]
                ids += step["token_ids"]
                first = first or (time.perf_counter() if ids else None)
                if step["round"]:  # a decoding round (0: the prefill's token): tokens, width
                    rounds.append((len(step["token_ids"]), step["block_size"]))
    return {"ids": ids, "sent": sent, "first": first, "end": time.perf_counter(), "rounds": rounds}


def batching_words(engine, worker: dict) -> str:
    """How the lanes' verifies and drafter calls ran: batched by the class, or one after another."""
    runner_class = type(engine.make_runner(collect_taps=False))
    drafter = engine.make_drafter()
    how = ("one batched forward (the runner's verify_batch)" if hasattr(runner_class, "verify_batch")
           else "one verify after another (no verify_batch on the runner)")
    drafts = ("one drafter pass (the drafter's propose_batch / propose_tree_batch)"
              if drafter is not None and hasattr(type(drafter), "propose_batch")
              else "one drafter call after another")
    verifies = worker["verifies"] / max(1, worker["verify_batches"])
    proposals = worker["proposals"] / max(1, worker["proposal_batches"])
    return (f"verifies of a tick ran as {how}, {verifies:.2f} lanes' verifies per tick on "
            f"average; drafter calls of a tick as {drafts}, {proposals:.2f} lanes' calls per "
            f"batch on average")


def record(args: argparse.Namespace, rows: list[dict], batching: str, memory: dict,
           prompt_count: int) -> dict:
    def column(key: str, label: str, decimals: int | None = 1) -> dict:
        return {"key": key, "label": label, **({"decimals": decimals} if decimals is not None else {})}

    counts = ",".join(str(count) for count in args.concurrency)
    return {
        "title": f"Many clients at once, {args.max_tokens} tokens a reply: tokens/s and time to first "
                 f"token ({args.engine})",
        "compares": f"speculative against plain at {counts} concurrent clients, through the "
                    f"worker's lanes",
        "measured": __doc__.split("\n\n")[1].replace("\n", " ").strip(),
        "dataset": f"{prompt_count} prompts: {' and '.join(dataset_names(args))} in turn; "
                   f"{args.max_tokens} tokens each",
        "date": time.strftime("%Y-%m-%d"),
        "engine": args.engine,
        "settings": {"temperature": 0, "block_size": str(args.block_size[0]),
                     "pair": Path(args.target).name if args.target else "embedded",
                     "stagger_s": args.stagger, "repeats": args.repeats, "verify": batching},
        "command": f"dflash-local bench --engine {args.engine} --concurrency {counts} "
                   f"--max-tokens {args.max_tokens} --stagger {args.stagger} "
                   f"--block-size {args.block_size[0]} --repeats {args.repeats}"
                   + (f" --dataset {args.dataset}" if args.dataset else "")
                   + (f" --record {args.record}" if args.record else ""),
        "source": "dflash_local/bench/concurrency.py, dflash_local/service/lanes.py",
        "row_header": "clients",
        "columns": [column("speculative_aggregate", "spec aggregate tok/s"),
                    column("plain_aggregate", "plain aggregate tok/s"),
                    column("speedup", "spec ÷ plain", 2),
                    column("speculative_one_by_one", "spec one by one tok/s"),
                    column("batch_gain", "spec aggregate ÷ one by one", 2),
                    column("speculative_tau", "spec τ", 2),
                    column("speculative_width", "spec mean width"),
                    column("speculative_per_request", "spec per-request tok/s"),
                    column("plain_per_request", "plain per-request tok/s"),
                    column("speculative_ttft", "spec TTFT (s)", 2),
                    column("plain_ttft", "plain TTFT (s)", 2),
                    column("identical", "replies identical to alone", None)],
        "rows": rows,
        "memory": memory,
        "notes": [f"Lanes: {batching}.",
                  f"Memory: {memory['words']}.",
                  ("Figures of one run compare with each other, not with another run's: the "
                   "machine's load changes between runs.")],
    }
