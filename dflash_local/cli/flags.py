"""The flags that more than one command takes (`generate`, `serve`, `bench`, `train`), each
declared once here, and the argparse types of the values they parse.

Boundary: argparse declarations only; what a flag means to a run is each command's. Where two
commands word a flag's help differently on purpose (serve's defaults come from the catalog,
bench measures several values side by side), the difference is a parameter.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from dflash_local.engines.table import engine_names
from dflash_local.errors import InvalidRequestError
from dflash_local.events import AUTO, BlockSize, check_draft_window, parse_block_size
from dflash_local.pairs.precision import DTYPE_CHOICES

DRAFTER_HELP = "DFlash drafter checkpoint"
BLOCK_SIZE_HELP = ("auto (default): the calibrated policy picks each round's width, plain "
                   "decoding when speculation would lose; N: always draft N-1 tokens")
DRAFT_WINDOW_HELP = ("the drafter keeps only the last N context rows (the draft sliding "
                     "window): draft cost and memory stay flat on long contexts; default: "
                     "unbounded")
DTYPE_HELP = "auto: float32 on a CPU (exactly lossless), the checkpoint's own on a GPU"


def block_size_arg(value: str) -> BlockSize:
    """The command-line form of GenerationParams.block_size: an integer >= 1 or "auto"."""
    try:
        return parse_block_size(value if value == "auto" else int(value))
    except (ValueError, InvalidRequestError):
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 or 'auto', got {value!r}") from None


def block_size_list_arg(text: str) -> tuple[BlockSize, ...]:
    """Several block sizes, comma-separated, each once, in the order given ("auto,4,16")."""
    return tuple(dict.fromkeys(block_size_arg(part.strip().lower()) for part in text.split(",")))


def draft_window_arg(value: str) -> int:
    """The command-line form of the draft window: an integer >= 1."""
    try:
        window = int(value)
        check_draft_window(window)
    except (ValueError, InvalidRequestError):
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value!r}") from None
    return window


def add_engine_flag(parser: argparse.ArgumentParser, kinds: Sequence[str] = (),
                    help: str | None = None) -> None:
    """`--engine`: "auto" or an engine of these kinds (engines/table.py; none named: every
    kind; generate runs the local ones)."""
    parser.add_argument("--engine", choices=["auto", *engine_names(*kinds)], default="auto", help=help)


def add_server_url_flags(parser: argparse.ArgumentParser, base_url_help: str, plain_help: str) -> None:
    """`--base-url`, `--plain-base-url`: the running servers `--engine openai` talks to."""
    parser.add_argument("--base-url", metavar="URL", help=base_url_help)
    parser.add_argument("--plain-base-url", metavar="URL", help=plain_help)


def add_target_flag(parser: argparse.ArgumentParser, help: str, *, required: bool = False,
                    metavar: str | None = "DIR|REPO") -> None:
    parser.add_argument("--target", metavar=metavar, required=required, help=help)


def add_pair_flags(parser: argparse.ArgumentParser, target_help: str,
                   drafter_help: str = DRAFTER_HELP) -> None:
    """`--target` and `--drafter`: a pair by its two models (a local directory or a hub repo)."""
    add_target_flag(parser, target_help)
    parser.add_argument("--drafter", metavar="DIR|REPO", help=drafter_help)


def add_block_size_flag(parser: argparse.ArgumentParser, help: str = BLOCK_SIZE_HELP,
                        default: BlockSize | None = AUTO, *, several: bool = False) -> None:
    """`--block-size`, the request's setting (GenerationParams.block_size); `several`: a
    comma-separated list of them (bench measures each side by side)."""
    if several:
        parser.add_argument("--block-size", type=block_size_list_arg, default=(default,),
                            metavar="B|auto", help=help)
    else:
        parser.add_argument("--block-size", type=block_size_arg, metavar="N|auto", default=default,
                            help=help)


def add_draft_window_flag(parser: argparse.ArgumentParser, help: str = DRAFT_WINDOW_HELP) -> None:
    parser.add_argument("--draft-window", type=draft_window_arg, metavar="N", help=help)


def add_dtype_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help=DTYPE_HELP)


def add_max_tokens_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256, metavar="N")


def add_temperature_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy")


def add_seed_flag(parser: argparse.ArgumentParser, default: int | None = None,
                  metavar: str | None = "S") -> None:
    """generate: no seed by default (a fresh sample each run); bench and train: 0 (repeatable)."""
    parser.add_argument("--seed", type=int, default=default, metavar=metavar)


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    """`--temperature`, `--top-p`, `--top-k`, `--seed`: the sampler of a generation."""
    add_temperature_flag(parser)
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P")
    parser.add_argument("--top-k", type=int, default=0, metavar="K", help="0 = no cut")
    add_seed_flag(parser)


def add_constraint_flags(parser: argparse.ArgumentParser) -> None:
    """The reply's structure: a JSON Schema, a Lark grammar or a regex (cli/options.py reads
    them into an OutputConstraint)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--json-schema", type=Path, metavar="FILE",
                       help="the reply is JSON that follows the JSON Schema in FILE")
    group.add_argument("--grammar", type=Path, metavar="FILE",
                       help="the reply follows the Lark grammar in FILE (its rule `start`)")
    group.add_argument("--regex", metavar="PATTERN", help="the reply matches PATTERN whole")


def add_recalibrate_flag(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument("--recalibrate", action="store_true", help=help)


def add_prefix_cache_flag(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument("--prefix-cache-mb", type=int, metavar="N", help=help)


def add_trace_flag(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument("--trace", type=Path, metavar="FILE", help=help)
