"""`dflash-local serve`: load a pair and serve it over HTTP. Parsing here; the service elsewhere.

Imports nothing heavy at module scope, so `dflash-local --help` stays fast.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

from dflash_local.cli import flags
from dflash_local.engines.table import LAUNCHED, RELAY, engine_names, kind_of

API_KEY_ENV = "DFLASH_LOCAL_API_KEY"


def add_parser(subparsers) -> argparse.ArgumentParser:
    serve = subparsers.add_parser(
        "serve", help="serve a pair over an OpenAI-compatible HTTP API (plus DFlash extensions)")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000, help="0 = any free port (printed)")
    flags.add_engine_flag(serve, help="openai: relay a running server (--base-url); vllm/sglang: start one")
    flags.add_server_url_flags(
        serve, base_url_help="--engine openai: the server's /v1 URL",
        plain_help="--engine openai: a plain server of the same target (speculation off, races)")
    serve.add_argument("--plain-twin", action="store_true",
                       help="--engine vllm/sglang: also start a plain server (speculation off, races)")
    serve.add_argument("--server-python", metavar="PATH",
                       help="--engine vllm/sglang: the interpreter whose venv has the server "
                            "(default: this one)")
    serve.add_argument("--server-args", metavar="ARGS", default="",
                       help="--engine vllm/sglang: more flags for the server, one string "
                            "(e.g. --server-args=\"--max-model-len 2048 --enforce-eager\")")
    serve.add_argument("--remote-api-key", metavar="KEY", help="the remote server's API key")
    serve.add_argument("--pair", metavar="ID", help="a catalog pair (default: embedded)")
    flags.add_pair_flags(serve, target_help="a target instead of a catalog pair",
                         drafter_help="the DFlash drafter for --target")
    flags.add_block_size_flag(serve, default=None,
                              help="default block size for requests (default: the catalog's for the "
                                   "pair, else auto for a local pair with a drafter)")
    flags.add_draft_window_flag(serve, help="the drafter keeps only the last N context rows (the draft "
                                            "sliding window; default: the catalog's for the pair, else "
                                            "unbounded)")
    flags.add_recalibrate_flag(serve, help="measure this machine's round costs for the pair again "
                                           "(block size auto), instead of the cached ones")
    flags.add_dtype_flag(serve)
    serve.add_argument("--api-key", metavar="KEY", default=os.environ.get(API_KEY_ENV),
                       help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})")
    serve.add_argument("--max-queue", type=int, default=8, metavar="N",
                       help="requests waiting for a place in the batch before 429s")
    serve.add_argument("--max-batch", type=int, metavar="N",
                       help="generations in flight at once, their rounds taken in turn (default: "
                            "4, fewer where memory cannot hold them at the full context; a "
                            "served engine: 1)")
    serve.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                       help="also answer requests whose Host header names NAME (repeatable; '*' "
                            "allows any). Default: loopback names and the --host address")
    serve.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, metavar="N",
                       help="refuse larger request bodies with 413 (default: 4 MiB)")
    flags.add_prefix_cache_flag(serve, help="memory for recent conversations' caches, reused by their "
                                            "next turn (local engines; default: 64K tokens of the pair, "
                                            "at most 1/8 of this machine's memory)")
    serve.add_argument("--prefix-cache-disk-mb", type=int, metavar="N",
                       help="disk for conversations' caches under the data dir, reused after a "
                            "restart (local engines; default: 2048, at most 1/4 of the free "
                            "space; 0: off)")
    serve.add_argument("--no-prefix-cache", action="store_true",
                       help="compute every prompt whole (no conversation cache)")
    serve.add_argument("--no-adapt", action="store_true",
                       help="do not record finished replies nor adapt the drafter to them (local "
                            "engines record them under the data dir by default and train the "
                            "drafter on them while idle; nothing leaves this machine: "
                            "dflash-local adapt status|reset|export)")
    serve.add_argument("--no-load", action="store_true", help="start with no pair loaded")
    serve.add_argument("--log-level", default="warning",
                       choices=["critical", "error", "warning", "info", "debug"])
    serve.set_defaults(handler=run, func=run)
    return serve


def run(args: argparse.Namespace) -> int:
    from dflash_local.cli.options import serve_options
    from dflash_local.errors import InvalidRequestError
    from dflash_local.service.app import create_app
    from dflash_local.service.parent_watch import watch_parent_from_env
    from dflash_local.service.server import bind, make_server
    from dflash_local.service.state import ServiceState

    watch_parent_from_env()  # started by dflash-chat: end with it, even during the first load
    if args.pair and args.target:
        raise InvalidRequestError("give --pair or --target, not both")
    if (kind_of(args.engine) == RELAY) != bool(args.base_url):
        raise InvalidRequestError(f"--base-url goes with --engine "
                                  f"{' or '.join(engine_names(RELAY))} (and it needs one)")
    if (args.server_python or args.server_args) and kind_of(args.engine) != LAUNCHED:
        raise InvalidRequestError(f"--server-python and --server-args go with --engine "
                                  f"{' or '.join(engine_names(LAUNCHED))}, "
                                  f"not --engine {args.engine}")
    if args.max_queue < 1:
        raise InvalidRequestError(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.max_batch is not None and args.max_batch < 1:
        raise InvalidRequestError(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.max_body_bytes < 1:
        raise InvalidRequestError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    _check_prefix_cache(args)
    if args.recalibrate and (args.no_load or kind_of(args.engine) in (LAUNCHED, RELAY)):
        raise InvalidRequestError("--recalibrate measures the local pair serve loads: not with "
                                  "--no-load or a served engine (POST /dflash/load takes "
                                  "\"recalibrate\": true)")
    if not args.api_key and not _is_loopback(args.host):
        print(f"warning: serving on {args.host} without --api-key: anyone who can reach it can "
              f"use it", file=sys.stderr)
    from dflash_local.cli.options import quiet_frameworks

    quiet_frameworks()
    # before torch loads: spinning OpenMP threads would starve the event loop's thread
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    state = ServiceState(api_key=args.api_key, max_queue=args.max_queue, max_batch=args.max_batch,
                         load_options=serve_options(args), on_loading_phase=_print_phase,
                         adapt=not args.no_adapt)
    if not args.no_load:
        _initial_load(state, args)
    if state.loaded is not None:
        from dflash_local.method.calibration_noise import warning_line

        line = warning_line(state.loaded.engine.calibration_status())
        if line is not None:
            print(line, file=sys.stderr, flush=True)
    sock = bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    served = state.loaded.served_name if state.loaded else "no pair loaded"
    print(f"dflash-local serving {served} on http://{host}:{port}", flush=True)
    app = create_app(state, allowed_hosts=allowed_hosts(args), max_body_bytes=args.max_body_bytes)
    make_server(app, args.log_level).run(sockets=[sock])
    return 0


def _print_phase(name: str, phase: str) -> None:
    """On stdout, where dflash-chat reads it while it waits for the serving line."""
    from dflash_local.method.calibration import CALIBRATING  # numpy: not for every CLI start
    from dflash_local.pairs.embedded import IMPORTING
    from dflash_local.service.state import LOADING

    what = {IMPORTING: "the embedded model, converted from its GGUF once, on the first start",
            LOADING: "its weights, into memory",
            CALIBRATING: "round costs on this machine, measured once per pair"}
    if phase in what:
        print(f"dflash-local {phase} {name} ({what[phase]})", flush=True)


def _initial_load(state, args: argparse.Namespace) -> None:
    from dflash_local.errors import MaxBatchError
    from dflash_local.pairs.hub import resolve_model
    from dflash_local.service.state import pick_engine

    if kind_of(args.engine) == RELAY:
        state.load(args.engine, args.base_url, None, served_name=args.base_url,
                   block_size=args.block_size, draft_window=args.draft_window)
        return
    if args.target:  # the local user's own names: paths and repo ids (downloaded if needed)
        target = resolve_model(args.target)
        drafter = resolve_model(args.drafter) if args.drafter else None
        state.load(pick_engine(args.engine), target, drafter, block_size=args.block_size,
                   recalibrate=args.recalibrate, draft_window=args.draft_window,
                   served_name=os.path.basename(args.target.rstrip("/")) or args.target)
        return
    try:
        state.load_pair(args.pair or "embedded", args.engine, args.block_size, args.recalibrate,
                        args.draft_window)
    except Exception as exc:
        if args.pair or isinstance(exc, MaxBatchError):  # the flag's own error: not a warning
            raise
        print(f"warning: the embedded pair could not be loaded ({exc}); serving with no pair "
              f"loaded: POST /dflash/load", file=sys.stderr)


def _check_prefix_cache(args: argparse.Namespace) -> None:
    """A RAM budget of 0 or more than this machine has, a disk budget below 0 or more than the
    free space, are refused before anything loads."""
    from dflash_local.engines.local import prefix_cache_root
    from dflash_local.errors import InvalidRequestError
    from dflash_local.method.prefix_cache import budget_bytes, machine_memory_bytes
    from dflash_local.method.prefix_disk import disk_budget_bytes

    for flag, value in (("--prefix-cache-mb", args.prefix_cache_mb),
                        ("--prefix-cache-disk-mb", args.prefix_cache_disk_mb)):
        if value is not None and args.no_prefix_cache:
            raise InvalidRequestError(f"give {flag} or --no-prefix-cache, not both")
    if args.prefix_cache_mb is not None:
        budget_bytes(args.prefix_cache_mb, machine_memory_bytes())
    if args.prefix_cache_disk_mb is not None:
        disk_budget_bytes(args.prefix_cache_disk_mb, prefix_cache_root())


def allowed_hosts(args: argparse.Namespace) -> list[str]:
    """Loopback names, the address served on (unless it is every address), and --allow-host."""
    from dflash_local.service.guards import LOOPBACK_HOSTS

    bound = [] if args.host in ("0.0.0.0", "::", "") else [args.host]
    return [*LOOPBACK_HOSTS, *bound, *args.allow_host]


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
