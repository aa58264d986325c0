"""`dflash-local launch claude|codex|opencode [--pair ID] [-- client args]`: an agent on a local pair.

Starts the service on a free loopback port with a random key (or attaches to one, `--server`),
with a pair that can serve the client (cli/agent_clients.py decides), then execs the client
pointed at it through its environment and `-c` overrides: the user's own config files are never
written. The service watches this process id, which the client inherits, and ends with it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from dflash_local.cli import flags
from dflash_local.cli.agent_clients import (
    API_KEY_ENV,
    CLIENTS,
    AgentClient,
    Service,
    check_loaded,
    pairs_that_serve,
    refusal,
    why_pair_cannot_serve,
)
from dflash_local.engines.table import LOCAL, engine_names, find_engine
from dflash_local.errors import DFlashError
from dflash_local.pairs.catalog import AVAILABLE, EMBEDDED_PAIR_ID, Catalog, PairSpec, load_catalog

SERVING_LINE = re.compile(r"serving .* on (http://\S+)")
PARENT_PID_ENV = "DFLASH_LOCAL_PARENT_PID"  # service/parent_watch.py: the service ends with us
POLL_S = 0.2


def add_parser(commands) -> argparse.ArgumentParser:
    launch = commands.add_parser(
        "launch", help="start Claude Code, Codex or opencode on a local pair",
        description="Start (or attach to) the service with a pair that can serve the agent "
                    "(tools, and context for its prompt), and run the agent pointed at it. "
                    "Arguments after -- go to the agent.")
    launch.add_argument("client", choices=sorted(CLIENTS), metavar="CLIENT",
                        help=f"one of {', '.join(sorted(CLIENTS))}")
    launch.add_argument("--pair", metavar="ID", help="a catalog pair (default: the first that "
                        "can serve the client and is on this machine)")
    launch.add_argument("--server", metavar="URL",
                        help=f"attach to a running service (its key: ${API_KEY_ENV})")
    flags.add_engine_flag(launch, [LOCAL])
    launch.set_defaults(handler=run_launch, client_args=[])
    return launch


def split_client_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """`launch ... -- ARGS`: (what our parser reads, the client's ARGS). Split before argparse,
    which would read the client's own options (`-c`, `--model`) as ours."""
    if argv[:1] == ["launch"] and "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1:]
    return argv, []


def run_launch(args: argparse.Namespace) -> int:
    client = CLIENTS[args.client]
    executable = shutil.which(client.executable)
    if executable is None:
        raise DFlashError(f"{client.executable} is not on PATH: npm install -g {client.package}")
    catalog = load_catalog()
    engines = local_engines_here(args.engine)
    if args.server:
        service = attach(args.server.rstrip("/"), os.environ.get(API_KEY_ENV, ""), client, catalog,
                         engines)
    else:
        pair = choose_pair(catalog, client, args.pair, engines)
        service = start_service(pair, args.engine)
    pointing = client.point(service)
    print(f"dflash-local: {client.name} on {service.model} at {service.url}", file=sys.stderr)
    sys.stderr.flush()
    os.execve(executable, [executable, *pointing.args, *args.client_args],
              {**os.environ, **pointing.env})
    return 0  # not reached: the client replaces this process


def local_engines_here(requested: str) -> frozenset[str]:
    """The local engines installed here (the one asked for, if one is)."""
    names = engine_names(LOCAL) if requested == "auto" else (requested,)
    return frozenset(name for name in names
                     if importlib.util.find_spec(find_engine(name).detect or name) is not None)


def choose_pair(catalog: Catalog, client: AgentClient, pair_id: str | None,
                engines: frozenset[str]) -> PairSpec:
    """The pair asked for, if it can serve the client; else the first that can and is here."""
    if pair_id is not None:
        pair = catalog.get(pair_id)
        reason = why_pair_cannot_serve(pair, client, engines)
        if reason is not None:
            raise refusal(pair.id, reason, catalog, client, engines)
        return pair
    fitting = pairs_that_serve(catalog, client, engines)
    downloaded = [pair for pair in fitting if _downloaded(pair)]
    if downloaded:
        return downloaded[0]
    reason = why_pair_cannot_serve(catalog.get(EMBEDDED_PAIR_ID), client, engines)
    raise refusal(EMBEDDED_PAIR_ID, f"{reason} (and no pair that can is downloaded: "
                  f"download one with dflash-chat's model picker or POST /dflash/downloads, then "
                  f"dflash-local launch {client.name} --pair ID)", catalog, client, engines)


def _downloaded(pair: PairSpec) -> bool:
    from dflash_local.pairs.catalog import find_local  # the hub's cache: not for --help

    return all(find_local(model)[0] == AVAILABLE for model in (pair.target, pair.drafter))


def start_service(pair: PairSpec, engine: str, serve_args: tuple[str, ...] = ()) -> Service:
    """`dflash-local serve` (plus `serve_args`) on a free loopback port with a random key, its
    output in a log file; waits for its serving line, echoing the load phases."""
    api_key = secrets.token_urlsafe(24)
    log_path = Path(tempfile.mkdtemp(prefix="dflash-launch-")) / "service.log"
    command = [sys.executable, "-m", "dflash_local.cli.main", "serve", "--host", "127.0.0.1",
               "--port", "0", "--pair", pair.id, "--engine", engine, *serve_args]
    env = {**os.environ, API_KEY_ENV: api_key, PARENT_PID_ENV: str(os.getpid())}
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   stdin=subprocess.DEVNULL)
    print(f"dflash-local: starting the service with {pair.id} (log: {log_path})", file=sys.stderr)
    url = _wait_serving(process, log_path)
    return attach(url, api_key)


def _wait_serving(process: subprocess.Popen, log_path: Path) -> str:
    shown = 0
    while True:
        lines = log_path.read_text(errors="replace").splitlines()
        for line in lines[shown:]:
            if line.startswith("dflash-local "):
                print(line, file=sys.stderr)
            if match := SERVING_LINE.search(line):
                return match.group(1)
        shown = len(lines)
        if process.poll() is not None:
            tail = "\n".join(lines[-15:])
            raise DFlashError(f"the service ended (exit {process.returncode}) before serving:\n{tail}")
        time.sleep(POLL_S)


def attach(url: str, api_key: str, client: AgentClient | None = None,
           catalog: Catalog | None = None, engines: frozenset[str] = frozenset()) -> Service:
    """The running service's loaded pair and context; with a client, refused if it cannot serve it."""
    status = _get_json(f"{url}/dflash/status", api_key)
    loaded = status.get("loaded")
    if not loaded:
        raise DFlashError(f"the service at {url} has no pair loaded: POST /dflash/load one")
    max_context = (status.get("capabilities") or {}).get("max_context")
    if client is not None and catalog is not None:
        check_loaded(client, loaded.get("pair"), max_context, catalog, engines)
    return Service(url=url, api_key=api_key or "dflash-local", model=loaded["served_name"],
                   max_context=max_context or 0)


def _get_json(url: str, api_key: str) -> dict:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())
    except (OSError, ValueError) as exc:  # refused, timed out, 401, not JSON
        raise DFlashError(f"cannot reach the service at {url}: {exc}") from None
