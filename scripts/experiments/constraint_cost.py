"""The constraint's own cost per token, this checkout's Guide against an older commit's, in one run.

    PYTHONPATH=. .venv/bin/python scripts/experiments/constraint_cost.py [--engine transformers|mlx]
        [--samples 4] [--max-tokens 96] [--old REV] [--repeats 5] [--plain]

Records real constrained DFlash generations (the json-extraction set, greedy, block size auto,
the embedded pair; `--plain`: constrained plain decoding): every call the loop makes on its guide (the draft it shapes, the target
logits it masks, the tokens it commits). Then replays those calls on a fresh matcher through
REV's method/constraint.py + constraints/matcher.py and through this checkout's, interleaved,
`--repeats` times: each replay must return exactly what the recording's guide returned (same
trees, same masked logits, same commits). Each generation's quickest replay per side counts;
their sum is divided by the tokens the generations committed. The target is out of the timing, so a shared machine's load hits both
sides alike.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dflash_local import events
from dflash_local.bench.datasets import json_extraction_prompts
from dflash_local.constraints import matcher as current_matcher
from dflash_local.engines import load_engine
from dflash_local.engines.options import EngineOptions
from dflash_local.method import constraint as current_constraint
from dflash_local.method import speculative
from dflash_local.pairs.default_pair import pair_names

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Recording:
    """One generation's guide: how it was made, and each call with what it returned."""

    constraint: events.OutputConstraint
    guide_args: tuple  # (stop_ids, free_draft, max_tokens)
    calls: list = field(default_factory=list)  # (method, args, result)
    tokens: int = 0


class Recorder:
    """A guide that records what the loop asks of the real one."""

    def __init__(self, guide, recording: Recording):
        self.guide, self.recording = guide, recording

    def _call(self, method: str, *args):
        copies = tuple(arg.copy() if isinstance(arg, np.ndarray) else arg for arg in args)
        result = getattr(self.guide, method)(*args)
        self.recording.calls.append((method, copies, result))
        if method == "commit":
            self.recording.tokens += len(result[0])
        return result

    def shape(self, draft):
        return self._call("shape", draft)

    def mask(self, logits):
        return self._call("mask", logits)

    def commit(self, token_ids, finish):
        return self._call("commit", list(token_ids), finish)


def record(engine_name: str, samples: int, max_tokens: int,
           speculative_decoding: bool) -> tuple[list[Recording], object]:
    target, drafter = pair_names(None, None, speculative=True)
    engine = load_engine(engine_name, target, drafter, options=EngineOptions(dtype="auto"))
    engine.prepare(events.AUTO)
    recordings, real_make_guide = [], speculative.make_guide
    for prompt in json_extraction_prompts(samples):
        def recording_guide(grammar, params, drafter, _prompt=prompt):
            guide = real_make_guide(grammar, params, drafter)
            recording = Recording(_prompt.constraint, (tuple(guide.stop_ids.tolist()),
                                                       guide.free_draft, guide.remaining))
            recordings.append(recording)
            return Recorder(guide, recording)
        speculative.make_guide = recording_guide
        try:
            ids = engine.encode_chat([{"role": "user", "content": prompt.turns[0]}])
            params = events.GenerationParams(max_tokens=max_tokens, block_size=events.AUTO,
                                             constraint=prompt.constraint,
                                             speculative=speculative_decoding)
            for _ in engine.stream(ids, params):
                pass
        finally:
            speculative.make_guide = real_make_guide
    return recordings, engine


def module_at(rev: str, path: str, name: str, folder: Path) -> types.ModuleType:
    """`path` as it was at `rev`, written under `folder` and loaded as module `name`."""
    copy = folder / f"{name}.py"
    copy.write_text(subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True,
                                   capture_output=True, text=True).stdout, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(name, copy)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def replay(recording: Recording, constraint_module, matcher_module, compiler) -> float:
    """Seconds the guide spent replaying `recording`; AssertionError where it differs.
    `compiler`: the engine's ConstraintCompiler."""
    fresh = compiler.grammar(recording.constraint)
    grammar = matcher_module.LLGuidanceGrammar(fresh._matcher, fresh._vocab_size,
                                               compiler._tokenizer_twin().eos_tokens)
    guide = constraint_module.Guide(grammar, *recording.guide_args)
    for method, args, expected in recording.calls:
        args = tuple(arg.copy() if isinstance(arg, np.ndarray) else arg for arg in args)
        result = getattr(guide, method)(*args)
        if method == "mask":
            assert result.dtype == expected.dtype and np.array_equal(result, expected), method
        elif method == "shape":
            assert (result.tree, result.mode, result.drafter_nodes, result.grafted) == (
                expected.tree, expected.mode, expected.drafter_nodes, expected.grafted), method
        else:
            assert result == expected, (method, result, expected)
    return grammar.busy_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="transformers", choices=["transformers", "mlx"])
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--old", default="main", help="the commit to compare with")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--plain", action="store_true", help="record constrained plain decoding")
    args = parser.parse_args()
    recordings, engine = record(args.engine, args.samples, args.max_tokens,
                                   not args.plain)
    tokens = sum(recording.tokens for recording in recordings)
    with tempfile.TemporaryDirectory() as folder:
        old_sides = (module_at(args.old, "dflash_local/method/constraint.py", "old_constraint",
                               Path(folder)),
                     module_at(args.old, "dflash_local/constraints/matcher.py", "old_matcher",
                               Path(folder)))
    sides = {args.old: old_sides, "this checkout": (current_constraint, current_matcher)}
    # each generation's quickest replay per side: a shared machine's stalls only ever add time
    best = {(name, index): float("inf") for name in sides for index in range(len(recordings))}
    for _ in range(args.repeats):
        for index, recording in enumerate(recordings):
            for name, (constraint_module, matcher_module) in sides.items():
                seconds = replay(recording, constraint_module, matcher_module, engine.constraints)
                best[name, index] = min(best[name, index], seconds)
    per_token = {name: round(1e6 * sum(best[name, index] for index in range(len(recordings)))
                             / tokens, 1) for name in sides}
    old, new = per_token.values()
    print(json.dumps({"engine": args.engine, "decoding": "plain" if args.plain else "dflash auto",
                      "generations": len(recordings), "tokens": tokens,
                      "repeats": args.repeats, "us_per_token": per_token,
                      "old_over_new": round(old / new, 2),
                      "time": time.strftime("%Y-%m-%d")}, indent=1))


if __name__ == "__main__":
    main()
