"""One benchmark session: every method on every prompt, interleaved, on one loaded engine.

Per sample (and per turn of a multi-turn prompt) the order is plain, then each speculative
configuration, then each peer, so slow drifts of a shared machine (load, heat, frequency) hit
every method alike; with `repeats` > 1 that round is run again and each method keeps its fastest
try (noise/steal only ever adds time). One unrecorded warm-up of each method comes first. A later turn sees the
earlier turns' answers as the speculative run wrote them (greedy: the plain answer too).
A served engine (our service, vLLM, SGLang: `tokenizes` False) gets the messages over HTTP and
reports acceptance from its server; a local engine and the peers get the template's token ids.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import NamedTuple

from dflash_local import machine_load
from dflash_local.bench import machine
from dflash_local.bench.datasets import BenchPrompt
from dflash_local.bench.measure import RunFigures, fastest, run_ours, run_served, summarize
from dflash_local.bench.noise import cpu_ticks, steal_share
from dflash_local.bench.peers import Peer, peers_for
from dflash_local.events import AUTO, BlockSize, Fixed, GenerationParams
from dflash_local.method import calibration

PLAIN = "plain"
WARMUP_TOKENS = 24


@dataclass(frozen=True)
class BenchSettings:
    block_sizes: tuple[BlockSize, ...] = (AUTO,)  # each one is a measured speculative method
    lookup: str = "on"  # auto's prompt-lookup rounds: "on", "off", or "both" (two methods)
    tree: str = "on"  # drafter rounds verify trees: "on", "off", or "both" (two methods each)
    max_tokens: int = 256
    temperature: float = 0.0
    thinking: bool | None = None
    max_samples: int = 10
    peers: bool = False
    ar_draft: str | None = None
    peer_python: str | None = None  # a peer environment's Python (the Mac peers' processes)
    mac_peers: tuple[str, ...] = ()  # which Mac peers to run with --peers
    seed: int = 0
    recalibrate: bool = False
    repeats: int = 1  # tries of every method per sample, the fastest kept
    draft_window: int | None = None  # the engine's draft sliding window (recorded, set at load)


class Prompt(NamedTuple):
    messages: list[dict]
    ids: list[int] | None  # None for a served engine: its server applies the template


def method_name(block_size: BlockSize, lookup: bool = True, tree: bool = True) -> str:
    name = "dflash auto" if block_size == AUTO else f"dflash B={block_size}"
    if block_size == AUTO and not lookup:
        name += ", no lookup"
    return name if tree else name + ", chains"


def run_suite(engine, prompts: dict[str, list[BenchPrompt]], settings: BenchSettings,
              log: Callable[[str], None] | None = None) -> dict:
    """Measure everything; returns the JSON record (report.py writes and prints it)."""
    log = log or _stderr
    started = time.perf_counter()
    calibrated = None
    served = not engine.capabilities.tokenizes
    if AUTO in settings.block_sizes and not served:  # a server plans its own rounds
        log("calibrating block widths (cached per machine and pair)...")
        calibrated = engine.calibrate(force=settings.recalibrate)
    peers = (peers_for(engine, settings.ar_draft, settings.peer_python, settings.mac_peers, log,
                       greedy=settings.temperature == 0) if settings.peers else [])
    try:
        results = _run_all(engine, prompts, settings, peers, log)
    finally:
        for peer in peers:
            if peer.close is not None:
                peer.close()
    return {
        "schema": "dflash-local-bench/1",
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "engine": engine.name,
        "versions": {"python": sys.version.split()[0], **calibration.framework_versions(),
                     "dflash-local": _own_version()},
        "machine": {**machine.describe(_threads(engine)), "load_average_end": _load()},
        "dtype": engine.pair.dtype, "threads": _threads(engine),
        "target": engine.pair.target, "drafter": engine.pair.drafter,
        "drafter_block_size": engine.pair.drafter_block,
        "draft_vocab_size": engine.pair.draft_vocab_size,
        "context_length": engine.capabilities.max_context,
        "settings": {**settings.__dict__,
                     "block_sizes": [size.request_value for size in settings.block_sizes]},
        "calibration": calibrated.to_json() if calibrated else None,
        "peers": {peer.name: peer.settings for peer in peers if peer.settings is not None},
        "datasets": results,
        "wall_s": round(time.perf_counter() - started, 1),
    }


def _run_all(engine, prompts: dict[str, list[BenchPrompt]], settings: BenchSettings,
             peers: list[Peer], log) -> dict:
    methods = _methods(engine, settings, peers)
    if any(item.constraint for items in prompts.values() for item in items):
        methods.update(_unconstrained(methods))
    first = next((p for ps in prompts.values() for p in ps), None)
    if first is not None:
        log("warm-up...")
        prompt = _prompt(engine, [_user(first.turns[0])], settings)
        _measure_sample(_labelled(engine, methods, "warm-up"), prompt,
                        _params(engine, settings, 0, WARMUP_TOKENS))
    return {name: _run_dataset(engine, name, items, methods, peers, settings, log)
            for name, items in prompts.items()}


def _methods(engine, settings: BenchSettings, peers: list[Peer]) -> dict:
    """name -> callable(Prompt, params) -> RunFigures, in the interleaving order."""
    if not engine.capabilities.tokenizes:
        return _served_methods(engine, settings)
    methods = {PLAIN: lambda prompt, params: run_ours(engine, prompt.ids,
                                                      replace(params, speculative=False))}
    switch = {"on": (True,), "off": (False,), "both": (True, False)}
    for block_size in settings.block_sizes:
        for lookup in switch[settings.lookup] if block_size == AUTO else (False,):
            for tree in switch[settings.tree]:
                methods[method_name(block_size, lookup, tree)] = (
                    lambda prompt, params, b=block_size, look=lookup, t=tree: run_ours(
                        engine, prompt.ids, replace(params, block_size=b, prompt_lookup=look,
                                                    tree=t)))
    methods.update({peer.name: lambda prompt, params, run=peer.run: run(prompt.ids, params)
                    for peer in peers if peer.run is not None})
    return methods


def _unconstrained(methods: dict) -> dict:
    """Each speculative method once more without the prompts' constraints: what structured
    output costs or saves against free text."""
    return {f"{name}, unconstrained": lambda prompt, params, run=run: run(
                prompt, replace(params, constraint=None))
            for name, run in methods.items() if name.startswith("dflash")}


def _served_methods(engine, settings: BenchSettings) -> dict:
    """Plain and the server's speculation; each block size where the server takes one per
    request (our service), else the server's own B. Lookup and trees are the server's settings."""
    def served(**change):
        return lambda prompt, params: run_served(engine, prompt.messages,
                                                 replace(params, **change), settings.thinking)

    methods = {PLAIN: served(speculative=False)}
    if engine.pair.drafter is None:
        return methods
    if not engine.capabilities.block_size_per_request:
        return {**methods, f"dflash (server, B={engine.pair.drafter_block})": served()}
    for block_size in settings.block_sizes:
        methods[method_name(block_size)] = served(block_size=block_size)
    return methods


def _run_dataset(engine, name: str, items: list[BenchPrompt], methods: dict, peers: list[Peer],
                 settings: BenchSettings, log) -> dict:
    load_start, ticks_start, sample_start = _load(), cpu_ticks(), machine_load.sample()
    runs: dict[str, list[RunFigures]] = {method: [] for method in methods}
    samples, skipped = [], []
    spec_method = next((m for m in methods if m.startswith("dflash")), PLAIN)
    for index, item in enumerate(items):
        messages: list[dict] = []
        for turn, text in enumerate(item.turns):
            messages.append(_user(text))
            prompt = _prompt(engine, list(messages), settings)
            if prompt.ids is not None and (len(prompt.ids) + settings.max_tokens
                                           > engine.capabilities.max_context):
                skipped.append({"id": item.prompt_id, "turn": turn, "prompt_tokens": len(prompt.ids)})
                log(f"[{name} {index + 1}/{len(items)}] skipped: {len(prompt.ids)} prompt tokens "
                    f"+ {settings.max_tokens} do not fit the context")
                break
            params = replace(_params(engine, settings, settings.seed + index, settings.max_tokens),
                             constraint=item.constraint)
            figures = _measure_sample(_labelled(engine, methods, item.prompt_id), prompt, params,
                                      settings.repeats)
            for method, run in figures.items():
                runs[method].append(run)
            samples.append(_sample_record(item, turn, figures))
            messages.append({"role": "assistant", "content": figures[spec_method].text})
            log(_progress(name, index, len(items), turn, figures))
    width = max((b.size or 0 for b in settings.block_sizes if isinstance(b, Fixed)), default=0)
    max_width = max(width, engine.pair.drafter_block)
    summaries = {method: summarize(method_runs, runs[PLAIN], max_width)
                 for method, method_runs in runs.items()}
    return {
        "methods": summaries,
        "unavailable": {peer.name: peer.unavailable for peer in peers if peer.run is None},
        "skipped_too_long": skipped,
        "load_average": {"start": load_start, "end": _load()},
        "cpu_steal_share": steal_share(ticks_start, cpu_ticks()),
        "others_cores": _rounded(machine_load.others_cores(sample_start, machine_load.sample())),
        "samples": samples,
    }


def _measure_sample(methods: dict, prompt: Prompt, params: GenerationParams,
                    repeats: int = 1) -> dict:
    """Every method on one prompt, `repeats` rounds in the interleaving order; the fastest
    try of each method is kept."""
    tries: dict[str, list[RunFigures]] = {name: [] for name in methods}
    for _ in range(repeats):
        for name, method in methods.items():
            tries[name].append(method(prompt, params))
    return {name: fastest(runs) for name, runs in tries.items()}


def _labelled(engine, methods: dict, prompt_id: str) -> dict:
    """With a round trace (bench --trace), each run names its generation "PROMPT-ID | METHOD"."""
    trace = getattr(engine, "round_trace", None)  # a served engine has none
    if trace is None:
        return methods

    def labelled(name: str, method):
        def run(prompt: Prompt, params: GenerationParams):
            trace.label = f"{prompt_id} | {name}"
            return method(prompt, params)
        return run

    return {name: labelled(name, method) for name, method in methods.items()}


def _sample_record(item: BenchPrompt, turn: int, figures: dict) -> dict:
    plain = figures[PLAIN]
    return {
        "id": item.prompt_id, "turn": turn, "prompt_tokens": plain.prompt_tokens,
        "methods": {name: run.to_json() for name, run in figures.items()},
        "identical_to_plain": {name: _same_output(run, plain)
                               for name, run in figures.items() if name != PLAIN},
    }


def _same_output(run: RunFigures, plain: RunFigures) -> bool:
    """Token for token; by text where a server sends no token ids."""
    if run.token_ids and plain.token_ids:
        return run.token_ids == plain.token_ids
    return run.text == plain.text and run.completion_tokens == plain.completion_tokens


def _prompt(engine, messages: list[dict], settings: BenchSettings) -> Prompt:
    if not engine.capabilities.tokenizes:
        return Prompt(messages, None)
    return Prompt(messages, engine.encode_chat(messages, thinking=settings.thinking))


def _threads(engine) -> int | None:
    threads = getattr(engine, "compute_threads", None)  # a served engine's are its server's
    return threads() if threads else None


def _params(engine, settings: BenchSettings, seed: int, max_tokens: int) -> GenerationParams:
    return GenerationParams(
        max_tokens=max_tokens, temperature=settings.temperature, seed=seed, speculative=True,
        stop_token_ids=tuple(getattr(engine, "eos_token_ids", ())),  # a server knows its own
    )


def _progress(name: str, index: int, total: int, turn: int, figures: dict) -> str:
    parts = [f"{method} {run.decode_tokens_per_s:.1f}" + (f" τ{run.tau:.2f}" if run.tau else "")
             for method, run in figures.items()]
    return f"[{name} {index + 1}/{total}{f' turn {turn + 1}' if turn else ''}] tok/s: " + ", ".join(parts)


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _own_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dflash-local")
    except PackageNotFoundError:
        return None


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
