"""Calibration: what one round costs at each block width on this machine, for a loaded pair.

An explicit step at load (the engine's `calibrate`, shown as a phase by the CLI, the service
and the app): it measures through the engine's own TargetRunner and Drafter (no framework
import here) the rounds the planners run (planning/planner.py: timed_rounds), and caches the result as JSON
under data_dir()/calibration/, one file per machine + engine + pair (+ drafter weights' size and
mtime) + dtype + framework versions. Two parts:
- costs: runner.verify + commit (+ the drafter's pass when w > 1; both kept, a prompt-lookup
  round pays only the first) for widths 1..B on a short context, the widths shuffled within
  each repetition, the lower quartile per width, then made non-decreasing in w (a wider verify
  never costs less; what says otherwise is noise); and how much each width's verify grows per
  token of context, from a few verifies on LONG_CONTEXT tokens (RoundCosts.at_context);
- batch: what one batched verify (and drafter pass) over several generations' rows costs per
  total rows, fitted as fixed + per row (calibration_batch.py), which prices a lane's round in
  a batch;
- prior: per-position acceptance of a short full-width generation on two fixed prompts, the
  starting point that the auto planner moves away from as a generation goes.
Timings taken while other work ran are noticed (calibration_noise.py): the costs are measured
once more, and a calibration still noisy is kept marked unreliable.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import itertools
import json
import logging
import os
import platform
import random
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from dflash_local import machine_load, paths
from dflash_local.events import Fixed, GenerationParams, StepEvent
from dflash_local.method.calibration_batch import BatchMeasurable, measure_batch
from dflash_local.method.calibration_noise import Noise, assess, lower_quartile
from dflash_local.method.planning.costs import BatchCosts, RoundCosts, smoothed_rates
from dflash_local.method.planning.planner import RoundShape, timed_rounds

if TYPE_CHECKING:
    from dflash_local.method.interfaces import TargetRunner

log = logging.getLogger(__name__)
CALIBRATING = "calibrating"  # the load phase while a pair's round costs are measured

# 2: weight-first head; 3: verify kept; 4: packed torch linears; 5: low quartile; 6: tree rounds;
# 8: grouped-query attention in torch CPU verifies (7 was a reverted cost model: never reused);
# 9: context slopes; 10: batched forwards' costs
CALIBRATION_VERSION = 10
CONTEXT_TEXT = (
    "Here is the documentation of a Python function. Explain it in simple words.\n\n"
    "Return a new sorted list from the items in iterable. Has two optional arguments which "
    "must be specified as keyword arguments: key and reverse."
)
PRIOR_PROMPTS = (
    "Explain how a hash table works, in a few sentences.",
    "Write a Python function that returns the n-th Fibonacci number.",
)
PRIOR_TOKENS = 32  # per prompt: enough for a prior, short for a first request that calibrates
REPETITIONS = 8
NOISY_RETRIES = 1  # a noisy measurement of the costs is taken once more; the quieter try is kept
LONG_CONTEXT = 1024  # tokens of context where the slopes are timed: a chat some turns long
SLOPE_REPETITIONS = 4  # of the long context's verifies, in the first repetitions of the short ones
FRAMEWORKS = ("torch", "transformers", "mlx", "mlx-lm", "numpy")


class Measurable(BatchMeasurable, Protocol):
    """What calibration measures through: a local engine's per-generation parts."""
    def encode_chat(self, messages: list[dict]) -> list[int]: ...
    def stream(self, prompt_ids: list[int], params: GenerationParams) -> Iterator[StepEvent]: ...


@dataclass(frozen=True)
class Calibration:
    costs: RoundCosts
    prior: tuple[float, ...]  # a_1..a_{B-1}
    key: dict
    measured_at: str
    measure_s: float
    noise: Noise | None = None  # how noisy its timings were (None: not assessed)

    @property
    def reliable(self) -> bool:
        return self.noise is None or self.noise.reliable

    def status(self) -> dict:
        """What /dflash/status and the CLI say of it: when, whether its timings are reliable and
        why not, and what a round costs as a lane's part of a batch (seconds)."""
        return {"measured_at": self.measured_at, "reliable": self.reliable,
                "noise": self.noise.to_json() if self.noise else None,
                "batch": self.costs.batch.to_json() if self.costs.batch else None}

    def to_json(self) -> dict:
        return {
            "version": CALIBRATION_VERSION, "key": self.key, "measured_at": self.measured_at,
            "measure_s": round(self.measure_s, 2), "reliable": self.reliable,
            "noise": self.noise.to_json() if self.noise else None,
            "round_seconds": list(self.costs.seconds),
            "verify_seconds": list(self.costs.verify_only),
            "relative_cost": [round(s / self.costs.seconds[0], 4) for s in self.costs.seconds],
            "acceptance_prior": [round(a, 4) for a in self.prior],
            "base_context": self.costs.base_context,
            "context_slopes": list(self.costs.context_slopes) if self.costs.context_slopes else None,
            "batch": self.costs.batch.to_json() if self.costs.batch else None,
        }

    @classmethod
    def from_json(cls, raw: dict) -> Calibration:
        slopes = raw.get("context_slopes")
        noise = Noise.from_json(raw["noise"]) if raw.get("noise") else None
        batch = BatchCosts.from_json(raw["batch"]) if raw.get("batch") else None
        costs = RoundCosts(tuple(raw["round_seconds"]), tuple(raw["verify_seconds"]),
                           raw.get("base_context", 0), tuple(slopes) if slopes else None, timed=True,
                           reliable=noise is None or noise.reliable, batch=batch)
        return cls(costs, tuple(raw["acceptance_prior"]),
                   raw["key"], raw["measured_at"], raw.get("measure_s", 0.0), noise)


def load_or_measure(engine: Measurable, key: dict, force: bool = False,
                    on_measure: Callable[[], None] | None = None) -> Calibration:
    """The calibration for `key`: from its cache file, else measured now (`on_measure` is
    called first: a caller shows what the wait is for); `force`: measure again."""
    path = cache_path(key)
    calibration = None if force else _read(path, key)
    if calibration is None:
        if on_measure is not None:
            on_measure()
        calibration = measure(engine, key)
        _write(path, calibration)
    return calibration


def measure(engine: Measurable, key: dict, repetitions: int = REPETITIONS) -> Calibration:
    started = time.perf_counter()
    costs, noise = quietest_costs(engine, repetitions)
    context_ids = engine.encode_chat([{"role": "user", "content": CONTEXT_TEXT}])
    batch = measure_batch(engine, context_ids, costs.max_width)
    costs = replace(costs, reliable=noise.reliable, batch=batch)  # a noisy one is checked sooner
    prior = measure_prior(engine, costs.max_width)
    return Calibration(costs, prior, key,
                       datetime.now(UTC).isoformat(timespec="seconds"),
                       time.perf_counter() - started, noise)


def quietest_costs(engine: Measurable, repetitions: int = REPETITIONS) -> tuple[RoundCosts, Noise]:
    """measure_costs, taken again (NOISY_RETRIES times at most) while the tries are noisy; the
    quietest try (reliable first, then the smallest spread) and its noise."""
    tries = []
    for _ in range(1 + NOISY_RETRIES):
        started = machine_load.sample()
        costs, samples = measure_costs(engine, repetitions)
        tries.append((costs, assess(samples, started)))
        if tries[-1][1].reliable:
            break
    return min(tries, key=lambda tried: (not tried[1].reliable, tried[1].spread))


def measure_costs(engine: Measurable,
                  repetitions: int = REPETITIONS) -> tuple[RoundCosts, dict[int, list[float]]]:
    """Seconds of one round per width 1..B (the lower quartile of the repetitions, widths in a
    shuffled order each time), and every repetition's seconds per width (for calibration_noise);
    one discarded warm-up pass first.

    The lower quartile, not the median: other work on a 2-core machine only ever adds time, and
    a calibration taken while it did (w2 measured 1.44x a step instead of 1.22x) made the policy
    write the drafter off for good. Verify and draft are fitted apart, each non-decreasing in w:
    a noisy plain step can then never make a speculative round look free (cost(w) >= cost(1) +
    a drafter pass). The drafter pass is timed at each drafted width; under auto's tree rounds,
    which draft the widest width allowed and verify a prefix, the width policy adds that widest
    pass to every verified width.
    """
    runner, drafter = engine.make_runner(collect_taps=True), engine.make_drafter()
    context_ids = engine.encode_chat([{"role": "user", "content": CONTEXT_TEXT}])
    _, taps = runner.prefill(context_ids)
    anchor_id = context_ids[-1]
    drafter.propose(anchor_id, taps, 2)  # the context enters the drafter's cache once
    block = drafter.drafter_block
    shapes = timed_rounds(block, runner.supports_tree and drafter.tree_drafts)
    filler = (context_ids * block)[:block]
    # each verify below keeps one row: on average they run on half of those rows more context
    timed_context = len(context_ids) + (repetitions + 1) * block // 2
    long = LongContextTimer.open(engine, context_ids, shapes, timed_context)
    verify_s: dict[int, list[float]] = {shape.width: [] for shape in shapes}
    draft_s: dict[int, list[float]] = {shape.width: [] for shape in shapes[1:]}
    order = random.Random(0)
    for repetition in range(repetitions + 1):
        order.shuffle(shapes)
        for shape in shapes:
            seconds, new_taps = _time_verify(runner, anchor_id, shape.filler_draft(filler))
            started = time.perf_counter()
            if shape.tree:
                drafter.propose_tree(anchor_id, new_taps, shape.width - 1)
            elif shape.width > 1:
                drafter.propose(anchor_id, new_taps, shape.width)
            drafted = time.perf_counter()
            if long is not None and repetition <= SLOPE_REPETITIONS:  # fewer: a long verify is dear
                long.time(shape, keep=repetition > 0)  # right after the short one: drift hits both
            if repetition:
                verify_s[shape.width].append(seconds)
                if shape.width > 1:
                    draft_s[shape.width].append(drafted - started)
    verify = non_decreasing([lower_quartile(verify_s[w]) for w in sorted(verify_s)])
    draft = non_decreasing([lower_quartile(draft_s[w]) for w in sorted(draft_s)])
    slopes = long.slopes(verify, timed_context) if long is not None else None
    rounds = {w: [v + d for v, d in zip(verify_s[w], draft_s.get(w, itertools.repeat(0.0)))]
              for w in verify_s}
    return RoundCosts(tuple(v + d for v, d in zip(verify, [0.0, *draft])), tuple(verify),
                      timed_context, slopes, timed=True), rounds


class LongContextTimer:
    """The verifies of a few widths on about LONG_CONTEXT tokens, timed between the short
    context's (measure_costs), and the seconds per token of context each width's verify adds
    (widths 1, 2, the first tree width, B/2 and B timed, the rest interpolated, non-decreasing
    in w). Only the verify is priced: the drafter pass is taken to cost the same on any context."""

    def __init__(self, runner: TargetRunner, anchor_id: int, filler: list[int],
                 widths: list[int], tokens: int, kept_rows: int):
        self.runner, self.anchor_id, self.filler = runner, anchor_id, filler
        self.tokens, self.kept_rows = tokens, kept_rows
        self.seconds: dict[int, list[float]] = {w: [] for w in widths}

    @property
    def widths(self) -> list[int]:
        return sorted(self.seconds)

    @classmethod
    def open(cls, engine: Measurable, text_ids: list[int], shapes: list[RoundShape],
             short_context: int, repetitions: int = SLOPE_REPETITIONS) -> LongContextTimer | None:
        """A runner prefilled with `text_ids` repeated to the long context; None where the
        target's context window is too short for one at least twice `short_context`."""
        block = len(shapes)
        first_tree = min((s.width for s in shapes if s.tree), default=2)
        widths = sorted({1, min(2, block), min(first_tree, block), max(1, block // 2), block})
        kept_rows = (repetitions + 1) * len(widths)  # one per verify: the context grows as it times
        runner = engine.make_runner(collect_taps=True)  # as the loop runs it: taps cost too
        tokens = min(LONG_CONTEXT, runner.max_context - block - kept_rows - 1)
        if tokens < 2 * short_context:
            return None
        context_ids = (text_ids * (tokens // len(text_ids) + 1))[:tokens]
        runner.prefill(context_ids)
        return cls(runner, context_ids[-1], (context_ids * block)[:block], widths, tokens, kept_rows)

    def time(self, shape: RoundShape, keep: bool = True) -> None:
        """One verify + commit of this round, if its width is one of the timed widths."""
        if shape.width in self.seconds:
            seconds, _ = _time_verify(self.runner, self.anchor_id, shape.filler_draft(self.filler))
            if keep:
                self.seconds[shape.width].append(seconds)

    def slopes(self, short_verify: list[float], short_context: int) -> tuple[float, ...]:
        """Per width 1..B, from `short_verify` timed on `short_context` tokens on average."""
        longer = self.tokens + self.kept_rows // 2 - short_context
        timed = self.widths
        slopes = [max(0.0, (lower_quartile(self.seconds[w]) - short_verify[w - 1]) / longer) for w in timed]
        block = len(short_verify)
        return tuple(non_decreasing([float(x) for x in np.interp(range(1, block + 1), timed, slopes)]))


def _time_verify(runner: TargetRunner, anchor_id: int, draft) -> tuple[float, object]:
    """(seconds, the kept row's taps) of the verify + commit of this draft, the anchor kept."""
    start = time.perf_counter()
    runner.verify(anchor_id, draft)
    new_taps = runner.commit([0])
    return time.perf_counter() - start, new_taps


def measure_prior(engine: Measurable, drafter_block: int, max_tokens: int = PRIOR_TOKENS) -> tuple[float, ...]:
    """Per-position acceptance of generations at the drafter's full block on PRIOR_PROMPTS."""
    hits, trials = [0] * (drafter_block - 1), [0] * (drafter_block - 1)
    params = GenerationParams(max_tokens=max_tokens, block_size=Fixed(drafter_block))
    for text in PRIOR_PROMPTS:
        prompt_ids = engine.encode_chat([{"role": "user", "content": text}])
        for event in engine.stream(prompt_ids, params):
            if event.round_index and event.draft_depth:
                # a tree's rows beyond its depth are alternatives, not positions
                for position in range(min(event.accepted + 1, event.draft_depth)):
                    trials[position] += 1
                    hits[position] += position < event.accepted
    return tuple(smoothed_rates(hits, trials))


def non_decreasing(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence (pool adjacent violators, equal weights)."""
    blocks: list[list[float]] = []  # [sum, count]
    for value in values:
        blocks.append([value, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(count)]


def calibration_key(pair, threads: int | None) -> dict:
    """What a calibration holds for: the pair (engines/interface.PairInfo) as loaded, on this machine
    with this many compute threads and these framework versions."""
    return {
        "engine": pair.engine, "dtype": pair.dtype, "block_size": pair.drafter_block,
        "target": str(pair.target_path or pair.target), "drafter": str(pair.drafter_path or pair.drafter),
        "drafter_weights": _weights_stamp(pair.drafter_path),
        "draft_vocab": pair.draft_vocab_size,  # a smaller draft head is a cheaper draft pass
        "machine": machine_info(), "threads": threads, "versions": framework_versions(),
    }


def cache_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(key["drafter"]).name)[:40]
    # not created here: a data dir that cannot be written only costs the cache (_write)
    return paths.data_dir_path() / "calibration" / f"{key['engine']}-{name}-{key['dtype']}-{digest}.json"


def machine_info() -> dict:
    return {"platform": platform.platform(), "machine": platform.machine(),
            "cpu_model": cpu_model(), "cores": os.cpu_count()}


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def framework_versions() -> dict:
    versions = {}
    for name in FRAMEWORKS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _weights_stamp(drafter_path: Path | None) -> list:
    if drafter_path is None:
        return []
    files = sorted(Path(drafter_path).glob("*.safetensors"))
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def _write(path: Path, calibration: Calibration) -> None:
    """Cache it for the next load; a full or read-only disk only costs that load a measurement
    (the loaded engine keeps it in memory), so it is a warning, not an error."""
    tmp = path.with_suffix(".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(calibration.to_json(), indent=2) + "\n")
        tmp.replace(path)
    except OSError as exc:
        with contextlib.suppress(OSError):  # a partial file, where there is a directory
            tmp.unlink(missing_ok=True)
        log.warning("the calibration could not be cached in %s (%s): the next load measures "
                    "again", path.parent, exc)


def _read(path: Path, key: dict) -> Calibration | None:
    """The cached calibration, or None if absent, unreadable or measured for another key."""
    try:
        raw = json.loads(path.read_text())
        if raw.get("version") != CALIBRATION_VERSION or raw.get("key") != key:
            return None
        return Calibration.from_json(raw)
    except (OSError, ValueError, KeyError, TypeError):
        return None
