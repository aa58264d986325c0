"""dflash-chat's command line: its flags and the `Options` they give the App (which service to
start or attach to). Boundary: no Textual, nothing started here."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Options:
    server: str | None = None  # connect to this service instead of starting one
    api_key: str | None = None  # for --server
    serve_args: tuple[str, ...] = ()  # passed to `serve` (--target, --drafter, --pair...)
    connect: bool = True  # False: no service at all (snapshot tests)
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the child
    serve_command: tuple[str, ...] | None = None  # what runs `serve` (default: this Python's)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflash-chat", description="Chat with a local model, sped up by DFlash.")
    parser.add_argument("--server", metavar="URL", help="use this running service, start none")
    parser.add_argument("--api-key", metavar="KEY", help="the --server's API key")
    parser.add_argument("--pair", metavar="ID", help="catalog pair to serve (default: embedded)")
    parser.add_argument("--target", metavar="DIR|REPO", help="serve this target instead")
    parser.add_argument("--drafter", metavar="DIR|REPO", help="the DFlash drafter for --target")
    parser.add_argument("--engine", choices=["auto", "transformers", "mlx"], default="auto")
    return parser


def options_from_args(args: argparse.Namespace) -> Options:
    serve_args = ["--engine", args.engine]
    for flag in ("pair", "target", "drafter"):
        if getattr(args, flag):
            serve_args += [f"--{flag}", getattr(args, flag)]
    return Options(server=args.server, api_key=args.api_key, serve_args=tuple(serve_args))
