"""Parsed command-line flags to EngineOptions (engines/options.py), per command: what each
command's flags ask of the engine it loads. Imports no engine: `--help` stays fast.
"""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path

from dflash_local.engines.options import EngineOptions
from dflash_local.engines.table import LAUNCHED, LOCAL, RELAY, engine_names, kind_of
from dflash_local.errors import DFlashError, InvalidRequestError
from dflash_local.events import OutputConstraint


def engine_options(args: argparse.Namespace) -> EngineOptions:
    """`generate`: --dtype and --draft-window."""
    return EngineOptions(dtype=args.dtype, draft_window=args.draft_window)


def output_constraint(args: argparse.Namespace) -> OutputConstraint | None:
    """`generate`: --json-schema FILE, --grammar FILE or --regex PATTERN, checked before any
    model loads (constraints/check.py names the flag and the reason)."""
    from dflash_local.constraints.check import check_constraint

    if args.json_schema is not None:
        field, constraint = f"--json-schema {args.json_schema}", _constraint_file("json_schema", args.json_schema)
    elif args.grammar is not None:
        field, constraint = f"--grammar {args.grammar}", _constraint_file("lark", args.grammar)
    elif args.regex is not None:
        field, constraint = "--regex", OutputConstraint("regex", args.regex)
    else:
        return None
    check_constraint(constraint, field)
    return constraint


def _constraint_file(kind: str, path: Path) -> OutputConstraint:
    try:
        return OutputConstraint(kind, path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"cannot read {path}: {exc}") from None


def bench_options(args: argparse.Namespace) -> EngineOptions:
    """`bench`: the relay's server key and plain server; else --dtype, --draft-window, and what
    a fair comparison needs: a launched server's plain twin (vLLM and SGLang speculate on every
    request), no prefix cache for a local engine (every method runs every prompt: a kept prefix
    would let the later ones skip the prefill)."""
    if kind_of(args.engine) == RELAY:
        if args.draft_window is not None:
            raise DFlashError(f"--draft-window {args.draft_window}: a relayed server keeps its own "
                              f"draft window (set it where that server starts)")
        return EngineOptions(api_key=args.api_key, plain_base_url=args.plain_base_url)
    if kind_of(args.engine) == LAUNCHED:
        return EngineOptions(dtype=args.dtype, draft_window=args.draft_window, plain_twin=True)
    return EngineOptions(dtype=args.dtype, draft_window=args.draft_window, prefix_cache=False)


def multiturn_options(args: argparse.Namespace) -> EngineOptions:
    """`bench --multi-turn`: --dtype and the prefix cache's budget it measures; no disk tier
    (an earlier run's entries would serve the first turns)."""
    return EngineOptions(dtype=args.dtype, prefix_cache_mb=args.prefix_cache_mb,
                         prefix_cache_disk_mb=0)


def serve_options(args: argparse.Namespace) -> dict[str, EngineOptions]:
    """`serve`: the options per engine it may load. --dtype applies to every engine that takes
    it, the prefix cache's flags to the local engines; the relay's and the launchers' flags only
    to the engine they were given with (the draft window comes with each load)."""
    shared = EngineOptions(dtype=args.dtype)
    local = EngineOptions(dtype=args.dtype, prefix_cache=not args.no_prefix_cache,
                          prefix_cache_mb=args.prefix_cache_mb,
                          prefix_cache_disk_mb=args.prefix_cache_disk_mb)
    options = {**dict.fromkeys(engine_names(LOCAL), local), **dict.fromkeys(engine_names(LAUNCHED), shared)}
    if kind_of(args.engine) == RELAY:
        options[args.engine] = EngineOptions(api_key=args.remote_api_key,
                                          plain_base_url=args.plain_base_url)
    elif kind_of(args.engine) == LAUNCHED:  # the launcher starts a plain twin for comparisons
        options[args.engine] = EngineOptions(dtype=args.dtype, plain_twin=args.plain_twin,
                                             server_python=args.server_python,
                                             extra_args=tuple(shlex.split(args.server_args)))
    return options


def quiet_frameworks() -> None:
    """Progress bars and advice from transformers/huggingface_hub would drown a command's output."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
