"""The drafter's shape for `dflash-local train`: layers, block size, taps and MASK, from the
options, else the --init-from drafter's, else the defaults; and the checks that weights and data
carry over only to the same shape."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import NamedTuple

from dflash_local.errors import DFlashError

MASK_CANDIDATES = ("<|mask|>", "<mask>", "<|MASK|>", "<empty_output>", "<|fim_pad|>")
DEFAULT_LAYERS = 2
DEFAULT_BLOCK_SIZE = 16


def choose_mask_token(tokenizer, requested: str | None) -> int:
    """An explicit choice, or the first special token of MASK_CANDIDATES the vocabulary has."""
    vocab = tokenizer.get_vocab()
    if requested is not None:
        if requested.isdigit() and int(requested) < len(vocab):
            return int(requested)
        if requested in vocab:
            return vocab[requested]
        raise DFlashError(f"--mask-token {requested!r} is not a token of this target's vocabulary")
    for candidate in MASK_CANDIDATES:
        if candidate in vocab:
            return vocab[candidate]
    raise DFlashError(
        f"the target has no usable MASK row (none of {', '.join(MASK_CANDIDATES)}); "
        "pass --mask-token with a rarely used special token"
    )


class DrafterShape(NamedTuple):
    """What a drafter's weights are laid out for; `--init-from` carries over only to the same."""

    layers: int
    block_size: int
    taps: tuple[int, ...]
    mask_id: int

    @classmethod
    def of(cls, config) -> DrafterShape:
        return cls(config.num_hidden_layers, config.block_size, tuple(config.target_layer_ids),
                   config.mask_token_id)


SHAPE_OPTIONS = DrafterShape("--layers", "--block-size", "--taps", "--mask-token (id)")


def drafter_shape(args: argparse.Namespace, init, tokenizer, target_layers: int) -> DrafterShape:
    """What the options say, else the --init-from drafter's shape, else the defaults."""
    from dflash_local.drafter.config import default_target_layer_ids

    if (args.layers is not None and args.layers < 1) or (args.block_size is not None and args.block_size < 2):
        raise DFlashError(f"--layers must be >= 1 and --block-size >= 2, got {args.layers} and "
                          f"{args.block_size}")
    start = DrafterShape.of(init) if init is not None else None
    layers = args.layers or (start.layers if start else DEFAULT_LAYERS)
    if args.taps:
        taps = _parse_taps(args.taps, target_layers)
    else:
        taps = start.taps if start else tuple(default_target_layer_ids(target_layers, layers))
    return DrafterShape(
        layers=layers,
        block_size=args.block_size or (start.block_size if start else DEFAULT_BLOCK_SIZE),
        taps=taps,
        mask_id=(start.mask_id if start and args.mask_token is None
                 else choose_mask_token(tokenizer, args.mask_token)),
    )


def _parse_taps(text: str, target_layers: int) -> tuple[int, ...]:
    try:
        taps = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise DFlashError(f"--taps wants comma-separated layer numbers, got {text!r}") from None
    outside = [tap for tap in taps if not 0 <= tap < target_layers]
    if outside:
        raise DFlashError(f"--taps {_shown(tuple(outside))}: the target's layers are 0..{target_layers - 1}")
    return taps


def check_same_shape(init_from: Path, init, shape: DrafterShape) -> None:
    """Weights carry over only to a drafter of the same shape: say which option differs."""
    differ = [f"{name} {_shown(asked)} (it has {_shown(had)})"
              for name, asked, had in zip(SHAPE_OPTIONS, shape, DrafterShape.of(init)) if asked != had]
    if differ:
        raise DFlashError(f"--init-from {init_from} is a different drafter: " + "; ".join(differ)
                          + ". Drop these options to continue its shape, or train from the target")


def check_taps_width(data_dir: Path, sequences: list[dict], taps: tuple, hidden_size: int) -> None:
    """Every sequence's taps as wide as these taps make them (data without a regen.json record
    may mix shards of other taps)."""
    widths = {sequence["taps"].shape[-1] for sequence in sequences}
    if widths != {len(taps) * hidden_size}:
        width = ", ".join(map(str, sorted(widths)))
        raise DFlashError(f"the taps in {data_dir} are {width} wide; {len(taps)} taps of hidden "
                          f"size {hidden_size} ({_shown(taps)}) need {len(taps) * hidden_size}: "
                          "pass the --taps the data was regenerated with, or another --data")


def dflash2_for(args: argparse.Namespace, init, hidden_size: int):
    """DFlash 2's sizes when the run trains one (--version 2, or continuing one), else None."""
    from dflash_local.train.trainer import dflash2_sizes

    had = init.dflash2 if init is not None else None
    version = args.version or (2 if had else 1)
    if version == 1 and had:
        raise DFlashError(f"--init-from {args.init_from} is a DFlash 2 drafter: --version 1 would drop "
                          "its convolutions and selector; continue it as --version 2")
    return None if version == 1 else had or dflash2_sizes(hidden_size)


def _shown(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
