"""Slow clients against `dflash-local serve` on the embedded pair (a child process): connections
that send nothing and connections that trickle their headers in a byte at a time, all opened at
once, each timed until the server closes it; meanwhile a well-behaved client's GET /health is
timed every second. Not run in CI (about 15 s plus the pair's load).

    .venv/bin/python scripts/slow_clients.py --record docs/records/slow-clients.json

The server's headers deadline (service/server.py, 10 s) should close every one of them about
10 s after it opened, a trickled one with a 408, and answer the well-behaved client throughout.
"""

from __future__ import annotations

import argparse
import selectors
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GIVE_UP_S = 40.0  # a connection still open by then is held: the measure fails
TRICKLE_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "


class SlowClient:
    def __init__(self, address: tuple[str, int], trickles: bool):
        self.sock = socket.create_connection(address)
        self.sock.setblocking(False)
        self.trickles = trickles
        self.opened = time.perf_counter()
        self.closed: float | None = None
        self.answer = b""

    def read(self) -> None:
        try:
            data = self.sock.recv(4096)
        except (ConnectionResetError, BlockingIOError):
            data = b""
        self.answer += data
        if not data:
            self.closed = time.perf_counter()

    def send_byte(self, sent: int) -> None:
        payload = TRICKLE_HEAD if sent == 0 else b"a"  # the headers never end
        try:
            self.sock.send(payload)
        except (BrokenPipeError, ConnectionResetError, BlockingIOError):
            pass  # the server closed it: the read says when


def hold(address: tuple[str, int], idle: int, trickling: int, trickle_s: float) -> list[SlowClient]:
    """Opens the clients, trickles a byte per `trickle_s` into the trickling ones, and reads
    each until the server closes it (or GIVE_UP_S)."""
    clients = [SlowClient(address, trickles=index >= idle) for index in range(idle + trickling)]
    selector = selectors.DefaultSelector()
    for client in clients:
        selector.register(client.sock, selectors.EVENT_READ, client)
    sent, started = 0, time.perf_counter()
    while any(client.closed is None for client in clients):
        now = time.perf_counter()
        if now - started > GIVE_UP_S:
            break
        if now - started >= sent * trickle_s:
            for client in clients:
                if client.trickles and client.closed is None:
                    client.send_byte(sent)
            sent += 1
        for key, _ in selector.select(timeout=0.05):
            client = key.data
            client.read()
            if client.closed is not None:
                selector.unregister(client.sock)
                client.sock.close()
    return clients


def watch_health(url: str, stop: threading.Event) -> list[float]:
    """A well-behaved client's GET /health, once a second: each answer's wall time."""
    import httpx

    times = []
    while not stop.wait(1.0):
        started = time.perf_counter()
        httpx.get(url + "/health", timeout=GIVE_UP_S).raise_for_status()
        times.append(time.perf_counter() - started)
    return times


def summary(label: str, clients: list[SlowClient]) -> dict:
    lifetimes = [client.closed - client.opened for client in clients if client.closed is not None]
    return {"label": label, "clients": len(clients), "closed": len(lifetimes),
            "answered_408": sum(client.answer.startswith(b"HTTP/1.1 408") for client in clients),
            "first_s": round(min(lifetimes, default=0.0), 2),
            "median_s": round(statistics.median(lifetimes), 2) if lifetimes else None,
            "last_s": round(max(lifetimes, default=0.0), 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["mlx", "transformers"], default="transformers")
    parser.add_argument("--idle", type=int, default=200, help="connections that send nothing")
    parser.add_argument("--trickling", type=int, default=200, help="connections trickling headers")
    parser.add_argument("--trickle-s", type=float, default=0.5, help="seconds between their bytes")
    parser.add_argument("--record", type=Path, help="write the JSON record here")
    args = parser.parse_args()
    from urllib.parse import urlsplit

    from dflash_local.cli.launch import start_service
    from dflash_local.pairs.catalog import EMBEDDED_PAIR_ID, load_catalog

    service = start_service(load_catalog().get(EMBEDDED_PAIR_ID), args.engine, ("--no-adapt",))
    address = (urlsplit(service.url).hostname, urlsplit(service.url).port)
    stop, health = threading.Event(), []
    watcher = threading.Thread(target=lambda: health.extend(watch_health(service.url, stop)))
    watcher.start()
    clients = hold(address, args.idle, args.trickling, args.trickle_s)
    stop.set()
    watcher.join()
    rows = [summary("sends nothing", clients[:args.idle]),
            summary(f"trickles its headers (a byte per {args.trickle_s:g} s)", clients[args.idle:])]
    for row in rows:
        print(f"{row['label']}: {row['closed']}/{row['clients']} closed, 408 to "
              f"{row['answered_408']}, after {row['first_s']}-{row['last_s']} s")
    print(f"GET /health meanwhile: {len(health)} answers, slowest {max(health, default=0):.3f} s")
    if args.record:
        record_results(args, rows, health)
    return 0 if all(row["closed"] == row["clients"] for row in rows) else 1


def record_results(args, rows: list[dict], health: list[float]) -> None:
    from dflash_local.bench.machine import describe_engine
    from dflash_local.bench.report import write_record

    record = {
        "title": "Slow clients are closed by the headers deadline",
        "compares": "connections that send nothing or trickle their headers: when the server "
                    "closes each, and a well-behaved client's answers meanwhile",
        "measured": "All connections opened at once against `dflash-local serve` on the embedded "
                    "pair; each one's time from its connect to the server's close, whether it "
                    "got a 408, and the wall time of a GET /health sent once a second meanwhile.",
        "dataset": f"{args.idle} idle and {args.trickling} header-trickling connections",
        "date": time.strftime("%Y-%m-%d"),
        "engine": args.engine,
        "settings": {"pair": "embedded", "headers_timeout_s": 10.0, "trickle_s": args.trickle_s,
                     "give_up_s": GIVE_UP_S, "health_answers": len(health),
                     "health_slowest_s": round(max(health, default=0.0), 3)},
        "command": f"scripts/slow_clients.py --engine {args.engine} --idle {args.idle} "
                   f"--trickling {args.trickling} --record {args.record}",
        "source": "scripts/slow_clients.py, dflash_local/service/server.py",
        "row_header": "connection",
        "columns": [{"key": "clients", "label": "connections", "decimals": 0},
                    {"key": "closed", "label": "closed by the server", "decimals": 0},
                    {"key": "answered_408", "label": "answered 408", "decimals": 0},
                    {"key": "first_s", "label": "first closed (s)", "decimals": 2},
                    {"key": "median_s", "label": "median (s)", "decimals": 2},
                    {"key": "last_s", "label": "last closed (s)", "decimals": 2}],
        "rows": rows,
    }
    write_record(args.record, record, machine=describe_engine(args.engine))


if __name__ == "__main__":
    raise SystemExit(main())
