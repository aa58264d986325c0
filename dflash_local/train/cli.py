"""`dflash-local train`: one command from a target to a z-lab-format drafter directory."""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import time
from pathlib import Path

from dflash_local.cli import flags
from dflash_local.drafter import draft_vocab
from dflash_local.errors import DFlashError
from dflash_local.train.chat_prompts import templated_chat_prompts
from dflash_local.train.prompts import DEFAULT_LIMIT, check_variant_range, training_prompts
from dflash_local.train.shape import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_LAYERS,
    check_same_shape,
    check_taps_width,
    dflash2_for,
    drafter_shape,
)


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
    _add_data_flags(parser)
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


def _add_data_flags(parser: argparse.ArgumentParser) -> None:
    """Which prompts are regenerated, and token archives restored or saved."""
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


def run(args: argparse.Namespace) -> int:
    """Check the options, load the target, regenerate or restore the data, then train (a DFlash
    drafter, or with --kind ar an autoregressive draft model; --steps 0: the data only)."""
    _check_options(args)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_local.drafter.config import load_checked_drafter_config, load_target_info
    from dflash_local.pairs.hub import resolve_model
    from dflash_local.train.regenerate import check_data_taps
    from dflash_local.train.token_archive import save_tokens, target_fingerprint
    from dflash_local.train.trainer import drafter_config_for, load_sequences

    torch.manual_seed(args.seed)
    target_dir = resolve_model(args.target)
    init = load_checked_drafter_config(args.init_from, target_dir) if args.init_from else None
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(args.device).eval()
    target.requires_grad_(False)  # frozen: its embeddings and head are shared, never trained
    shape = drafter_shape(args, init, tokenizer, target.config.num_hidden_layers)
    if init is not None:
        check_same_shape(args.init_from, init, shape)  # before minutes of loading data
    dflash2 = dflash2_for(args, init, target.config.hidden_size)
    data_dir = args.data or args.out.with_name(args.out.name + ".data")
    started = time.perf_counter()
    fingerprint = target_fingerprint(load_target_info(target_dir))
    _gather_data(args, target, tokenizer, shape.taps, data_dir, fingerprint)
    regen_minutes = (time.perf_counter() - started) / 60
    data_only = args.steps == 0  # no drafter, so no taps to match (regeneration checked its own)
    config = drafter_config_for(target.config, shape.layers, shape.block_size, shape.taps,
                                shape.mask_id, dflash2)
    if args.kind != "ar" and not data_only:
        check_data_taps(data_dir, shape.taps, config.hidden_size)
    sequences = load_sequences(data_dir)
    if args.save_tokens is not None or data_only:
        saved = save_tokens(sequences, args.save_tokens, tokenizer, fingerprint) if args.save_tokens else None
        _report_data(data_dir, sequences, saved)
    if data_only:
        return 0
    if args.kind == "ar":
        return _train_ar(args, target, tokenizer, sequences, started)
    check_taps_width(data_dir, sequences, shape.taps, config.hidden_size)
    return _train_dflash(args, config, target, init, sequences,
                         {"regen_minutes": round(regen_minutes, 1), "started": started})


def _check_options(args: argparse.Namespace) -> None:
    """Every refusal the options alone decide, before anything loads."""
    if args.draft_vocab < 0:
        raise DFlashError(f"--draft-vocab must be 0 (the full head) or a positive count, got {args.draft_vocab}")
    if args.steps is not None and args.steps < 0:
        raise DFlashError(f"--steps must be 0 (regenerate only) or a positive count, got {args.steps}")
    if args.steps is None and not args.train_minutes > 0:
        raise DFlashError(f"--train-minutes must be positive (or give --steps), got {args.train_minutes}")
    if args.kind == "ar" and args.init_from:
        raise DFlashError("--init-from continues a DFlash drafter; --kind ar starts from the target")
    check_variant_range(args.prompt_variants, args.prompt_variants_from)
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


def _gather_data(args: argparse.Namespace, target, tokenizer, taps: tuple[int, ...],
                 data_dir: Path, fingerprint) -> None:
    """Restore --tokens archives (their taps recomputed) and regenerate for --regen-minutes."""
    import torch

    from dflash_local.train.regenerate import MAX_PROMPT_TOKENS, follow_up_prompts, regenerate
    from dflash_local.train.token_archive import load_tokens, retap

    archived = [load_tokens(path, tokenizer, fingerprint) for path in args.tokens]  # all checked first
    if not archived and args.regen_minutes <= 0:
        return
    # a bfloat16 copy decodes ~2x faster on avx512_bf16 at large batches; greedy tokens may
    # differ from float32's where two logits tie within bf16 precision
    regen_model = copy.deepcopy(target).to(torch.bfloat16) if args.bf16 else target
    for sequences in archived:
        retap(regen_model, sequences, taps, data_dir)
    if args.regen_minutes <= 0:
        return
    max_prompt_tokens = MAX_PROMPT_TOKENS  # prompts built (the stdlib parsed) only when regenerated
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


def _train_dflash(args: argparse.Namespace, config, target, init, sequences: list[dict],
                  timing: dict) -> int:
    """A DFlash drafter started from --init-from or from the target, trained, and its report."""
    from dflash_local.drafter.model_torch import DFlashDrafter, load_drafter
    from dflash_local.train.trainer import (
        TrainSettings,
        init_from_target,
        start_dflash2_parts,
        train,
    )

    drafter = DFlashDrafter(config).to(args.device)
    drafter.bind(target.get_input_embeddings(), target.get_output_embeddings())
    if args.init_from:
        upgrading = config.dflash2 is not None and init.dflash2 is None
        loaded = drafter.load_state_dict(load_drafter(args.init_from).state_dict(), strict=not upgrading)
        if upgrading:  # the v1 weights, DFlash 2's own parts started as their equal
            assert not loaded.unexpected_keys, loaded.unexpected_keys
            start_dflash2_parts(drafter, args.seed)
    else:
        init_from_target(drafter, target)
        if config.dflash2 is not None:
            start_dflash2_parts(drafter, args.seed)
    settings = TrainSettings(block_size=config.block_size, gamma=_gamma(config.block_size),
                             steps=args.steps, train_minutes=args.train_minutes, seed=args.seed,
                             lr=args.lr or TrainSettings.lr, bf16=args.bf16)
    draft_ids = choose_training_draft_vocab(args.out, sequences, args.draft_vocab, config.vocab_size,
                                            init_from=args.init_from)
    if draft_ids:  # trained over the set it will draft from (and cheaper steps)
        drafter.restrict_draft_vocab(draft_ids)
    report = train(drafter, sequences, args.out, settings)
    report.update({
        "target": str(args.target), "init_from": str(args.init_from) if args.init_from else None,
        "version": config.version, "taps": list(config.target_layer_ids),
        "mask_token_id": config.mask_token_id,
        "sequences": len(sequences), "regenerated_tokens": _response_tokens(sequences),
        "drafter_parameters": sum(p.numel() for p in drafter.parameters()),
        "regen_minutes": timing["regen_minutes"],
        "total_minutes": round((time.perf_counter() - timing["started"]) / 60, 1),
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
