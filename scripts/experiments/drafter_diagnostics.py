"""Two checks of the shipped drafter behind the loop's design, on the embedded pair (Transformers
engine, greedy, block size auto, lookup and trees on, held-out prompts):

- calibration: every verified drafter node's path probability against whether the target kept
  it, by depth and by probability bin. TreeSizer scales all nodes by one kept/predicted ratio;
  this says whether a per-depth or per-bin correction would have anything to correct.
- truncation: every drafter round is drafted again from the same context with a shorter block
  (the anchor + W-1 masks instead of the checkpoint's block size) and its greedy chain compared
  with the full block's first W-1 positions: top-1 agreement per position, and how many tokens of
  each chain the target kept. The target's tokens are known as far as the round kept plus its
  next token, so both chains are counted against that (a chain matching all of it is cut there).
  Drafting a shorter block would cost less; this says what it would do to the drafts.

    .venv/bin/python scripts/experiments/drafter_diagnostics.py [--samples 10] [--max-tokens 128] [--width 8]
        [--out runs/drafter-diagnostics.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch

from dflash_local import paths
from dflash_local.bench.datasets import load_prompts
from dflash_local.drafter import model_torch
from dflash_local.engines.torch_engine import TorchEngine
from dflash_local.events import AUTO, GenerationParams
from dflash_local.method import speculative
from dflash_local.method.planning.auto import common_start  # the planner's own prefix count
from dflash_local.pairs.embedded import embedded_target_dir

PROBABILITY_BINS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0)


@contextmanager
def patched(owner, name: str, wrapper):
    original = getattr(owner, name)
    setattr(owner, name, wrapper(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


class Recorder:
    def __init__(self, width: int):
        self.width = width
        self.nodes: list[tuple[int, float, bool]] = []  # (depth, path probability, kept)
        self.chains: dict[str, list[int]] = {}  # this round's full and short greedy chains
        self.rounds: list[tuple[list[bool], int, int]] = []  # (top-1 agreement, kept full, kept short)

    def draft(self, original):
        def wrapped(session, anchor_id, new_taps, width):
            hidden = original(session, anchor_id, new_taps, width)
            if width > self.width:
                self.chains = {"full": _greedy(session, hidden)[: self.width - 1],
                               "short": _greedy(session, self._short(session, anchor_id, new_taps))}
            return hidden
        return wrapped

    def _short(self, session, anchor_id: int, new_taps):
        """The same round drafted from a block of `width`: the context is cached already."""
        mask = session.model.config.mask_token_id
        block = torch.tensor([[anchor_id] + [mask] * (self.width - 1)], device=session._device)
        with torch.inference_mode():
            return session.model.draft(block, new_taps[:, :0].to(session._dtype), session.cache)[:, 1:]

    def accept(self, original):
        def wrapped(tree, logits, params, rng):
            result = original(tree, logits, params, rng)
            if not tree.path_probs:  # a chain: a lookup copy or a plain step
                return result
            path, next_id = set(result[0]), result[1]
            kept_ids = [tree.token_ids[node - 1] for node in result[0]]
            for node, prob in enumerate(tree.path_probs, start=1):
                if prob > 0:  # 0: a grafted lookup token, not the drafter's
                    self.nodes.append((tree.depths[node], prob, node in path))
            if self.chains:
                truth = [*kept_ids, next_id]
                full, short = self.chains["full"], self.chains["short"]
                self.rounds.append(([a == b for a, b in zip(full, short)],
                                    common_start(truth, full), common_start(truth, short)))
                self.chains = {}
            return result
        return wrapped

    def report(self) -> dict:
        if not self.nodes or not self.rounds:
            raise SystemExit("no drafter tree round was verified: nothing to report (a drafter "
                             "whose target keeps chains, or prompts decoded plainly throughout)")
        nodes = np.array(self.nodes, dtype=np.float64).reshape(-1, 3)
        depth, prob, kept = nodes[:, 0], nodes[:, 1], nodes[:, 2]
        by_depth = [{"depth": int(d), "nodes": int((depth == d).sum()),
                     "predicted": round(float(prob[depth == d].sum()), 2),
                     "kept": int(kept[depth == d].sum())} for d in np.unique(depth)]
        by_bin = []
        for low, high in itertools.pairwise(PROBABILITY_BINS):
            inside = (prob >= low) & ((prob < high) if high < 1.0 else (prob <= high))
            if inside.any():
                by_bin.append({"bin": [low, high], "nodes": int(inside.sum()),
                               "mean_probability": round(float(prob[inside].mean()), 3),
                               "kept_rate": round(float(kept[inside].mean()), 3)})
        agreement = [np.mean([r[0][i] for r in self.rounds if len(r[0]) > i]) for i in range(self.width - 1)]
        return {
            "calibration": {"nodes": len(nodes), "kept_over_predicted": round(float(kept.sum() / prob.sum()), 3),
                            "by_depth": by_depth, "by_probability": by_bin},
            "truncation": {"width": self.width, "rounds": len(self.rounds),
                           "top1_agreement_by_position": [round(float(a), 3) for a in agreement],
                           "kept_full_block": sum(r[1] for r in self.rounds),
                           "kept_short_block": sum(r[2] for r in self.rounds)},
        }


def _greedy(session, hidden) -> list[int]:
    with torch.inference_mode():
        return session.model.draft_token_ids(hidden)[0].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--width", type=int, default=8, help="the shorter block's width (anchor included)")
    parser.add_argument("--drafter", type=Path, default=paths.shipped_models_dir() / "smollm2-135m-dflash")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    engine = TorchEngine(embedded_target_dir(), args.drafter)
    if args.width < 2 or args.width >= engine.pair.drafter_block:
        parser.error(f"--width must be between 2 and the drafter's block size - 1 ({engine.pair.drafter_block - 1})")
    recorder = Recorder(args.width)
    with (patched(model_torch.DraftSession, "_draft", recorder.draft),
          patched(speculative, "_accept", recorder.accept)):
        engine.calibrate()
        for prompt in load_prompts("embedded", args.samples):
            ids = engine.encode_chat([{"role": "user", "content": prompt.turns[0]}])
            for _ in engine.stream(ids, GenerationParams(max_tokens=args.max_tokens, block_size=AUTO)):
                pass
    report = {"samples": args.samples, "max_tokens": args.max_tokens, "drafter": str(args.drafter),
              **recorder.report()}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
