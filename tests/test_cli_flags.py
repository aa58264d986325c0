"""The flags that generate, serve, bench and train share (declared once in cli/flags.py): each
command's `--help` lists them, and where two commands mean the same thing they say it in the
same words."""

from __future__ import annotations

import argparse

import pytest

from dflash_local.cli import flags
from dflash_local.cli.main import build_parser, main

COMMANDS = ("generate", "serve", "bench", "train")
# flag -> the commands that take it
SHARED = {
    "--engine": ("generate", "serve", "bench"),
    "--base-url": ("serve", "bench"),
    "--plain-base-url": ("serve", "bench"),
    "--target": COMMANDS,
    "--drafter": ("generate", "serve", "bench"),
    "--block-size": COMMANDS,
    "--draft-window": ("generate", "serve", "bench"),
    "--dtype": ("generate", "serve", "bench"),
    "--max-tokens": ("generate", "bench"),
    "--temperature": ("generate", "bench"),
    "--seed": ("generate", "bench", "train"),
    "--recalibrate": ("generate", "serve", "bench"),
    "--prefix-cache-mb": ("serve", "bench"),
    "--trace": ("generate", "bench"),
}
# commands whose entry for the flag is the same, word for word
SAME_ENTRY = [("--dtype", ("generate", "serve", "bench")), ("--draft-window", ("generate", "bench")),
              ("--drafter", ("generate", "bench")), ("--max-tokens", ("generate", "bench")),
              ("--temperature", ("generate", "bench")), ("--seed", ("bench", "train"))]
# flags.py's own wording, where a command takes the flag as declared there
DECLARED_HELP = [("--dtype", "generate", flags.DTYPE_HELP), ("--block-size", "generate", flags.BLOCK_SIZE_HELP),
                 ("--draft-window", "bench", flags.DRAFT_WINDOW_HELP), ("--drafter", "serve", None),
                 ("--drafter", "generate", flags.DRAFTER_HELP)]


def command_parser(command: str) -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[command]


def entry(command: str, flag: str) -> str:
    """The flag's entry in `dflash-local COMMAND --help` (invocation and help), without whitespace
    (help wraps at spaces and hyphens)."""
    parser = command_parser(command)
    action = next(a for a in parser._actions if flag in a.option_strings)
    formatter = parser._get_formatter()
    formatter.add_argument(action)
    return folded(formatter.format_help())


def folded(text: str) -> str:
    return "".join(text.split())


def printed_help(command: str, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    return folded(capsys.readouterr().out)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_lists_its_shared_flags_in_its_help(command, capsys):
    printed = printed_help(command, capsys)
    for flag, takers in SHARED.items():
        if command in takers:
            assert entry(command, flag) in printed, (command, flag)
        else:
            assert f"[{flag}" not in printed, (command, flag)  # not in the usage line


@pytest.mark.parametrize(("flag", "commands"), SAME_ENTRY, ids=[flag for flag, _ in SAME_ENTRY])
def test_a_shared_flag_reads_the_same_in_every_command_that_means_the_same(flag, commands):
    entries = {command: entry(command, flag) for command in commands}
    assert len(set(entries.values())) == 1, entries


@pytest.mark.parametrize(("flag", "command", "wording"), DECLARED_HELP)
def test_a_flag_taken_as_declared_says_what_flags_py_says(flag, command, wording):
    said = entry(command, flag)
    if wording is None:  # serve words it its own way
        assert folded(flags.DRAFTER_HELP) not in said
    else:
        assert said.endswith(folded(wording)), said
