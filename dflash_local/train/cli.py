"""`dflash-local train`: one command from a target to a z-lab-format drafter directory."""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import time
from pathlib import Path
from typing import NamedTuple

from dflash_local.cli import flags
from dflash_local.drafter import draft_vocab
from dflash_local.errors import DFlashError
from dflash_local.train.chat_prompts import templated_chat_prompts
from dflash_local.train.prompts import DEFAULT_LIMIT, check_variant_range, training_prompts

MASK_CANDIDATES = ("<|mask|>", "<mask>", "<|MASK|>", "<empty_output>", "<|fim_pad|>")
DEFAULT_LAYERS = 2
DEFAULT_BLOCK_SIZE = 16


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("train", help="train a DFlash drafter for a target")
    flags.add_target_flag(parser, "target model directory or hub repo id", required=True, metavar=None)
    parser.add_argument("--out", required=True, type=Path, help="output drafter directory")
    parser.add_argument("--data", type=Path, help="regenerated-data directory (default: <out>.data)")
    parser.add_argument("--regen-minutes", type=float, default=35.0)
    parser.add_argument("--train-minutes", type=float, default=40.0)
    parser.add_argument("--steps", type=int, help="fixed step count (default: fit to --train-minutes); 0: only "
                        "regenerate, restore --tokens and --save-tokens, no drafter")
    parser.add_argument("--version", type=int, choices=[1, 2],
                        help="DFlash v1 or DFlash 2 (default: --init-from's, else 1); 2 from a v1 "
                             "--init-from adds identity convolutions and a neutral selector")
    parser.add_argument("--kind", choices=["dflash", "ar"], default="dflash",
                        help="ar: an autoregressive draft model from the same data (the bench peer)")
    parser.add_argument("--layers", type=int,
                        help=f"drafter layers (default {DEFAULT_LAYERS}, or --init-from's)")
    parser.add_argument("--block-size", type=int,
                        help=f"default {DEFAULT_BLOCK_SIZE}, or --init-from's")
    parser.add_argument("--taps", help="comma-separated target layer ids (default: z-lab's rule, "
                                       "or --init-from's)")
    parser.add_argument("--mask-token", help="token string or id used as MASK (default: the "
                                             "first of the usual mask tokens, or --init-from's)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32, help="regeneration batch size")
    parser.add_argument("--prompts-limit", type=int, default=DEFAULT_LIMIT)
    parser.add_argument("--prompt-variants", type=int, default=0, metavar="N",
                        help="N more framings of each training docstring: more data from the same corpus")
    parser.add_argument("--prompt-variants-from", type=int, default=0, metavar="K",
                        help="only framings K..N (--prompt-variants N): fresh data for a continued "
                             "drafter whose earlier framings were regenerated elsewhere")
    parser.add_argument("--prompt-corpus", type=Path, metavar="DIR",
                        help="frame prompts around the docstrings of the Python sources in DIR "
                             "(DIR/*.py, DIR/*/*.py) instead of the standard library's: fresh data "
                             "for a continued drafter; held-out stdlib docstrings stay out")
    parser.add_argument("--chat-prompts", action="store_true",
                        help="templated chat requests (explain, advise, write, compare) crossed "
                             "with topics, in place of the default prompts: fresh chat data for a "
                             "continued drafter; no topic of a held-out chat prompt")
    parser.add_argument("--chat-followups", action="store_true",
                        help="a second turn for each --chat-prompts request answered in --data: the "
                             "request, the target's answer and a follow-up ('Can you give me an "
                             "example?'), in place of the default prompts: chat data of a "
                             "conversation going on")
    parser.add_argument("--tokens", type=Path, action="append", default=[], metavar="FILE",
                        help="a token archive (--save-tokens) to put into --data first: one forward "
                             "pass per sequence gives its taps back, instead of regenerating it "
                             "(repeatable; prompts already in --data are skipped)")
    parser.add_argument("--save-tokens", type=Path, metavar="FILE",
                        help="after regenerating, save the sequences of --data that train uses, "
                             "without their taps (a few MB: the data moves to another machine, "
                             "and --tokens restores it)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    flags.add_seed_flag(parser, default=0, metavar=None)
    parser.add_argument("--init-from", type=Path, metavar="DIR",
                        help="start from this drafter's weights (a longer second run) instead of the target's layers")
    parser.add_argument("--lr", type=float, help="peak learning rate (default 6e-4)")
    parser.add_argument("--draft-vocab", type=int, default=draft_vocab.DEFAULT_SIZE, metavar="N",
                        help="train and draft over the N ids the target outputs most in the data "
                             "(written as draft_vocab.json; the engines score only those); 0: the "
                             "full head; a resumed run keeps its set, and so does one continuing an "
                             "--init-from drafter that has a set of this size; not used by --kind ar")
    parser.add_argument("--bf16", action="store_true",
                        help="bfloat16 training autocast and regeneration: about 2x faster on CPUs "
                             "with avx512_bf16, and on CUDA")
    parser.set_defaults(handler=run)


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


def run(args: argparse.Namespace) -> int:
    if args.draft_vocab < 0:
        raise DFlashError(f"--draft-vocab must be 0 (the full head) or a positive count, got {args.draft_vocab}")
    if args.steps is not None and args.steps < 0:
        raise DFlashError(f"--steps must be 0 (regenerate only) or a positive count, got {args.steps}")
    if args.steps is None and not args.train_minutes > 0:
        raise DFlashError(f"--train-minutes must be positive (or give --steps), got {args.train_minutes}")
    if args.kind == "ar" and args.init_from:
        raise DFlashError("--init-from continues a DFlash drafter; --kind ar starts from the target")
    check_variant_range(args.prompt_variants, args.prompt_variants_from)  # before loading anything
    missing = [str(path) for path in args.tokens if not path.is_file()]
    if missing:
        raise DFlashError(f"--tokens: no such file: {', '.join(missing)}")
    if args.prompt_corpus is not None and not args.prompt_corpus.is_dir():
        raise DFlashError(f"--prompt-corpus {args.prompt_corpus} is not a directory")
    if args.chat_prompts and args.chat_followups:
        raise DFlashError("--chat-followups continues the answers to --chat-prompts: regenerate "
                          "those first, then run again with --chat-followups")
    chat = "--chat-prompts" if args.chat_prompts else "--chat-followups" if args.chat_followups else None
    if chat and args.regen_minutes <= 0:
        raise DFlashError(f"{chat} chooses the prompts to regenerate: give --regen-minutes > 0")
    if chat and (args.prompt_corpus is not None or args.prompt_variants
                 or args.prompts_limit != DEFAULT_LIMIT):
        raise DFlashError(f"{chat} replaces the default prompts (docstrings and hand-written "
                          "chat): drop --prompt-corpus, --prompt-variants and --prompts-limit, or "
                          "regenerate those in another run")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_local.drafter.config import load_checked_drafter_config, load_target_info
    from dflash_local.drafter.model_torch import DFlashDrafter, load_drafter
    from dflash_local.pairs.hub import resolve_model
    from dflash_local.train.regenerate import (
        MAX_PROMPT_TOKENS,
        check_data_taps,
        follow_up_prompts,
        regenerate,
    )
    from dflash_local.train.token_archive import load_tokens, retap, save_tokens, target_fingerprint
    from dflash_local.train.trainer import (
        TrainSettings,
        drafter_config_for,
        init_from_target,
        load_sequences,
        start_dflash2_parts,
        train,
    )

    torch.manual_seed(args.seed)
    target_dir = resolve_model(args.target)
    init = load_checked_drafter_config(args.init_from, target_dir) if args.init_from else None
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(args.device).eval()
    target.requires_grad_(False)  # frozen: its embeddings and head are shared, never trained
    shape = drafter_shape(args, init, tokenizer, target.config.num_hidden_layers)
    if init is not None:
        check_same_shape(args.init_from, init, shape)  # before minutes of loading data
    layers, block_size, taps, mask_id = shape
    dflash2 = dflash2_for(args, init, target.config.hidden_size)
    data_dir = args.data or args.out.with_name(args.out.name + ".data")
    started = time.perf_counter()
    fingerprint = target_fingerprint(load_target_info(target_dir))
    archived = [load_tokens(path, tokenizer, fingerprint) for path in args.tokens]  # all checked first
    if archived or args.regen_minutes > 0:
        # a bfloat16 copy decodes ~2x faster on avx512_bf16 at large batches; greedy tokens may
        # differ from float32's where two logits tie within bf16 precision
        regen_model = copy.deepcopy(target).to(torch.bfloat16) if args.bf16 else target
        for sequences in archived:
            retap(regen_model, sequences, taps, data_dir)
        if args.regen_minutes > 0:  # prompts built (the stdlib parsed) only when regenerated
            max_prompt_tokens = MAX_PROMPT_TOKENS
            if args.chat_prompts:
                train_prompts = templated_chat_prompts()
            elif args.chat_followups:
                train_prompts = follow_up_prompts(tokenizer, data_dir)
                max_prompt_tokens = None  # the first turn was held to it; the answer is the target's
            else:
                train_prompts = training_prompts(limit=args.prompts_limit, variants=args.prompt_variants,
                                                 variants_from=args.prompt_variants_from,
                                                 corpus=args.prompt_corpus)
            regenerate(regen_model, tokenizer, train_prompts, taps, data_dir, batch_size=args.batch_size,
                       max_new_tokens=args.max_new_tokens, max_prompt_tokens=max_prompt_tokens,
                       max_minutes=args.regen_minutes)
        del regen_model, archived
    regen_minutes = (time.perf_counter() - started) / 60
    data_only = args.steps == 0  # no drafter, so no taps to match (regeneration checked its own)
    config = drafter_config_for(target.config, layers, block_size, taps, mask_id, dflash2)
    if args.kind != "ar" and not data_only:
        check_data_taps(data_dir, taps, config.hidden_size)
    sequences = load_sequences(data_dir)
    if args.save_tokens is not None or data_only:
        saved = save_tokens(sequences, args.save_tokens, tokenizer, fingerprint) if args.save_tokens else None
        _report_data(data_dir, sequences, saved)
    if data_only:
        return 0
    if args.kind == "ar":
        return _train_ar(args, target, tokenizer, sequences, started)
    check_taps_width(data_dir, sequences, taps, config.hidden_size)
    drafter = DFlashDrafter(config).to(args.device)
    drafter.bind(target.get_input_embeddings(), target.get_output_embeddings())
    if args.init_from:
        upgrading = dflash2 is not None and init.dflash2 is None
        loaded = drafter.load_state_dict(load_drafter(args.init_from).state_dict(), strict=not upgrading)
        if upgrading:  # the v1 weights, DFlash 2's own parts started as their equal
            assert not loaded.unexpected_keys, loaded.unexpected_keys
            start_dflash2_parts(drafter, args.seed)
    else:
        init_from_target(drafter, target)
        if dflash2 is not None:
            start_dflash2_parts(drafter, args.seed)
    settings = TrainSettings(block_size=block_size, gamma=_gamma(block_size),
                             steps=args.steps, train_minutes=args.train_minutes, seed=args.seed,
                             lr=args.lr or TrainSettings.lr, bf16=args.bf16)
    draft_ids = choose_training_draft_vocab(args.out, sequences, args.draft_vocab, config.vocab_size,
                                            init_from=args.init_from)
    if draft_ids:  # trained over the set it will draft from (and cheaper steps)
        drafter.restrict_draft_vocab(draft_ids)
    report = train(drafter, sequences, args.out, settings)
    report.update({
        "target": str(args.target), "init_from": str(args.init_from) if args.init_from else None,
        "version": config.version, "taps": list(taps), "mask_token_id": mask_id,
        "sequences": len(sequences), "regenerated_tokens": _response_tokens(sequences),
        "drafter_parameters": sum(p.numel() for p in drafter.parameters()),
        "regen_minutes": round(regen_minutes, 1),
        "total_minutes": round((time.perf_counter() - started) / 60, 1),
    })
    (args.out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["held_out"]))
    return 0


def _response_tokens(sequences: list[dict]) -> int:
    return sum(len(s["tokens"]) - s["prompt_len"] for s in sequences)


def _report_data(data_dir: Path, sequences: list[dict], saved: Path | None) -> None:
    print(f"{data_dir}: {len(sequences)} sequences, {_response_tokens(sequences)} response tokens")
    if saved:
        print(f"saved {len(sequences)} sequences to {saved}")


def choose_training_draft_vocab(out: Path, sequences: list[dict], size: int, vocab_size: int,
                                init_from: Path | None = None) -> list[int] | None:
    """The set to train over, written before the first step so every checkpoint carries it: on a
    resumed run the one it started with (data added since must not change it mid-schedule); when
    continuing a drafter (`init_from`) that drafts over a set of this size, its set (it was
    trained over it, on more data than a continuation may bring); else the `size` most frequent
    response ids of the training split (not the validation slice)."""
    from dflash_local.train.trainer import checkpoint_path_for, split_validation

    if size <= 0:
        (out / draft_vocab.FILE_NAME).unlink(missing_ok=True)  # full-head weights: no stale set
        return None
    if checkpoint_path_for(out).exists():
        kept = draft_vocab.load_draft_vocab(out, vocab_size)
        if kept is not None:
            return kept
    inherited = draft_vocab.load_draft_vocab(init_from, vocab_size) if init_from else None
    if inherited is not None and len(inherited) == size:
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(init_from / draft_vocab.FILE_NAME, out / draft_vocab.FILE_NAME)
        return inherited
    counts = draft_vocab.count_response_tokens(split_validation(sequences)[1])
    draft_ids = draft_vocab.choose_draft_vocab(counts, size)
    out.mkdir(parents=True, exist_ok=True)
    draft_vocab.write_draft_vocab(out, draft_ids, counts)
    return draft_ids


def _train_ar(args: argparse.Namespace, target, tokenizer, sequences, started: float) -> int:
    from dflash_local.pairs.embedded import make_config_portable
    from dflash_local.train.ar_draft import ar_draft_from_target, train_ar_draft
    from dflash_local.train.trainer import TrainSettings

    draft = ar_draft_from_target(target, args.layers or DEFAULT_LAYERS).to(args.device)
    settings = TrainSettings(steps=args.steps, train_minutes=args.train_minutes, seed=args.seed,
                             lr=args.lr or TrainSettings.lr, bf16=args.bf16)
    report = train_ar_draft(draft, sequences, args.out, settings)
    tokenizer.save_pretrained(args.out)
    make_config_portable(args.out)  # mlx-lm's draft-model peer loads it too
    report.update({"kind": "ar", "target": str(args.target), "sequences": len(sequences),
                   "total_minutes": round((time.perf_counter() - started) / 60, 1)})
    (args.out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["held_out"]))
    return 0


def _gamma(block_size: int) -> float:
    """The published decay constants: 7 for B=16, 5 for 10, 4 for 8."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(2.0, block_size * 7 / 16))
