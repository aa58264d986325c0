"""Teacher-forced quality of drafters on held-out prompts no drafter was trained on.

The trainer's own held-out figure is a slice of the regenerated shards, and which sequences that
slice holds shifts when more data is added; this script instead regenerates responses for the
prompts hashed into the held-out split (train/prompts.py: never regenerated for training) with
the float32 target, as the engines run it, caches them, and evaluates each drafter given on the
same blocks (same anchors): loss, accuracy of the first draft, τ at the drafter's block size;
over all of them, and over the hand-written chat prompts among them apart (`chat`).
A drafter with a draft_vocab.json is evaluated as the engines run it, over that set (its loss is
then over the set too: compare losses between drafters evaluated alike); --full-head ignores it.

    .venv/bin/python scripts/eval_drafter_heldout.py models/smollm2-135m-dflash runs/other-drafter
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_local.drafter.draft_vocab import load_draft_vocab
from dflash_local.drafter.model_torch import load_drafter
from dflash_local.pairs.embedded import embedded_target_dir
from dflash_local.train.prompts import CHAT_PROMPTS, all_prompts, split_prompts
from dflash_local.train.regenerate import encode_prompts, prompt_key, regenerate
from dflash_local.train.trainer import TrainSettings, evaluate, load_sequences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("drafters", nargs="+", type=Path)
    parser.add_argument("--prompts", type=int, default=96, help="held-out prompts to use")
    parser.add_argument("--data", type=Path, default=Path("runs/heldout-eval"))
    vocab = parser.add_mutually_exclusive_group()
    vocab.add_argument("--vocab-from", type=Path, metavar="DIR",
                       help="evaluate every drafter over this directory's draft_vocab.json")
    vocab.add_argument("--full-head", action="store_true", help="ignore draft_vocab.json files")
    args = parser.parse_args()

    target_dir = embedded_target_dir()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    target.requires_grad_(False)
    held_out = split_prompts(all_prompts())[1][: args.prompts]
    drafters = [load_drafter(path) for path in args.drafters]
    taps = drafters[0].config.target_layer_ids
    if any(d.config.target_layer_ids != taps for d in drafters):
        raise SystemExit("the drafters tap different target layers: evaluate them apart")
    regenerate(target, tokenizer, held_out, tuple(taps), args.data, batch_size=32)
    sequences = load_sequences(args.data)
    chat_keys = {tuple(ids) for ids in encode_prompts(tokenizer, CHAT_PROMPTS)}
    chat = [s for s in sequences if prompt_key(s) in chat_keys]
    results = {}
    for path, drafter in zip(args.drafters, drafters):
        drafter.bind(target.get_input_embeddings(), target.get_output_embeddings())
        draft_ids = None if args.full_head else load_draft_vocab(args.vocab_from or path, drafter.config.vocab_size)
        if draft_ids:
            drafter.restrict_draft_vocab(draft_ids)
        settings = TrainSettings(block_size=drafter.config.block_size)
        results[str(path)] = {**_rounded(evaluate(drafter.eval(), sequences, settings)),
                              "chat": _rounded(evaluate(drafter, chat, settings)) if chat else None,
                              "draft_vocab": len(draft_ids) if draft_ids else None}
    tokens = sum(len(s["tokens"]) - s["prompt_len"] for s in sequences)
    print(json.dumps({"held_out_prompts": len(sequences), "chat_prompts": len(chat),
                      "response_tokens": tokens, "drafters": results}, indent=2))


def _rounded(figures: dict) -> dict:
    return {name: round(value, 4) for name, value in figures.items()}


if __name__ == "__main__":
    main()
