"""`dflash-local bench --multi-turn`: two-turn conversations with the prefix cache off and on,
in one run on one loaded engine, then the cache's memory under many interleaved conversations.

Three ways per conversation: `off` (no cache); `on`, the next turn sent the moment a reply ends
(the service's warm-up of the next turn, engines/turn_warmup.py, would be cut at once: none
runs); `pause`, the user reads the reply first, long enough for the warm-up to end (it runs to
its end between the turns; its time, `warm_s`, is the reading time it needs). The bars are read
on `pause`, a chat's usual rhythm; `on` is the worst case, recorded beside it.
Per conversation the three rotate which goes first (a shared machine's drift hits all alike);
the cache is emptied before each cached conversation, so its turn 1 starts cold and its turn 2
finds what turn 1 left. Turn 2 sees turn 1's answer as that run wrote it (greedy: the same text
every way, which the record checks). Time to first token is wall time from the request to the
first event (a restore included); end to end, to the last.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from dflash_local.bench.datasets import BenchPrompt
from dflash_local.events import GenerationParams, GenerationStats
from dflash_local.method.prefix_cache import MIB, PrefixCache

MEMORY_TOKENS = 64  # the memory check's answers are at most this long
MODES = ("off", "on", "pause")
BAR_MODE = "pause"  # the bars' reading: a user reads a reply before the next turn


@dataclass
class TurnFigures:
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    end_to_end_s: float
    completion_tokens: int
    token_ids: list[int] = field(repr=False)
    text: str = field(repr=False)
    warm_s: float = 0.0  # `pause`: the warm-up of the next turn after this reply

    def to_json(self) -> dict:
        return {key: round(value, 4) if isinstance(value, float) else value
                for key, value in asdict(self).items() if key not in ("token_ids", "text")}


def run_turn(engine, prompt_ids: list[int], params: GenerationParams) -> TurnFigures:
    stats, tokens, parts = GenerationStats(), [], []
    start = time.perf_counter()
    first = None
    for event in engine.stream(prompt_ids, params):
        first = first if first is not None else time.perf_counter() - start
        stats.add(event)
        tokens.extend(event.token_ids)
        parts.append(event.text)
    return TurnFigures(len(prompt_ids), stats.cached_tokens, first, time.perf_counter() - start,
                       len(tokens), tokens, "".join(parts))


def run_conversation(engine, item: BenchPrompt, params: GenerationParams, mode: str,
                     thinking: bool | None = None, prefix: str = "") -> list[TurnFigures]:
    """Every turn of one conversation in one of MODES (the cache emptied first where on)."""
    kept = engine.prefix_cache
    if mode == "off":
        engine.prefix_cache = None
    else:
        kept.clear()
    try:
        messages, turns = [], []
        for index, text in enumerate(item.turns):
            messages.append({"role": "user", "content": prefix + text if not turns else text})
            prompt_ids = engine.encode_chat(messages, thinking=thinking)
            figures = run_turn(engine, prompt_ids, params)
            if mode == "pause" and index + 1 < len(item.turns):
                start = time.perf_counter()  # the service's idle worker does this
                engine.warm_next_turn(messages, figures.text, prompt_ids, params, thinking,
                                      lambda: False)
                figures.warm_s = time.perf_counter() - start
            messages.append({"role": "assistant", "content": figures.text})
            turns.append(figures)
        return turns
    finally:
        engine.prefix_cache = kept


def measure_turns(engine, items: list[BenchPrompt], params: GenerationParams,
                  thinking: bool | None, log: Callable[[str], None]) -> dict:
    """Each conversation every way (MODES); the per-turn medians and the bars' ratios."""
    samples = []
    for index, item in enumerate(items):
        order = MODES[index % len(MODES):] + MODES[:index % len(MODES)]
        runs = {mode: run_conversation(engine, item, params, mode, thinking) for mode in order}
        turns = list(zip(*(runs[mode] for mode in MODES), strict=True))
        samples.append({"id": item.prompt_id, "turns": [
            {**{mode: figures.to_json() for mode, figures in zip(MODES, row, strict=True)},
             "identical": all(figures.token_ids == row[0].token_ids for figures in row)}
            for row in turns]})
        log(f"[{item.prompt_id}] " + "; ".join(
            f"turn {t + 1}: ttft " + " ".join(f"{mode} {figures.ttft_s:.2f}s"
                                              for mode, figures in zip(MODES, row, strict=True))
            + f", cached on {row[1].cached_tokens} pause {row[2].cached_tokens}"
            for t, row in enumerate(turns)))
    return {"samples": samples, "summary": _summary(samples)}


def _summary(samples: list[dict]) -> dict:
    turns = max(len(sample["turns"]) for sample in samples)
    summary = {}
    for turn in range(turns):
        rows = [s["turns"][turn] for s in samples if len(s["turns"]) > turn]
        summary[f"turn {turn + 1}"] = {
            f"{key}_{mode}": round(statistics.median(row[mode][key] for row in rows), 4)
            for mode in MODES for key in ("ttft_s", "end_to_end_s", "prompt_tokens",
                                          "cached_tokens", "warm_s")}
        summary[f"turn {turn + 1}"]["identical"] = all(row["identical"] for row in rows)
    if turns >= 2:
        summary["bars"] = {"mode": BAR_MODE}
        for mode in ("on", "pause"):
            first, second = ([s["turns"][t][mode] for s in samples] for t in (0, 1))
            # per conversation, then the worst: each conversation must meet the bar
            summary["bars"][f"ttft_turn2_over_turn1_{mode}_max"] = round(max(
                b["ttft_s"] / a["ttft_s"] for a, b in zip(first, second, strict=True)), 4)
            summary["bars"][f"cached_over_turn1_prompt_{mode}_min"] = round(min(
                b["cached_tokens"] / a["prompt_tokens"] for a, b in zip(first, second, strict=True)), 4)
    return summary


def measure_memory(engine, items: list[BenchPrompt], params: GenerationParams,
                   conversations: int, budget: int, thinking: bool | None,
                   log: Callable[[str], None]) -> dict:
    """`conversations` two-turn chats interleaved (every first turn, then every second) through
    a cache of `budget` bytes, each reply's next turn warmed after it as the idle service warms
    it (engines/turn_warmup.py): the cache's size after every turn and warm-up, never above the
    budget."""
    import psutil

    kept, engine.prefix_cache = engine.prefix_cache, PrefixCache(budget)
    process = psutil.Process()
    rss_start = process.memory_info().rss
    held, own, talks, first_prompts, warmed = [], [], [], [], 0
    try:
        for turn in range(2):
            for index in range(conversations):
                item = items[index % len(items)]
                if turn == 0:  # a distinct opening per conversation: 20 chats, not 4
                    talks.append([{"role": "user", "content": f"(chat {index}) {item.turns[0]}"}])
                else:
                    talks[index].append({"role": "user", "content": item.turns[1]})
                prompt_ids = engine.encode_chat(talks[index], thinking=thinking)
                figures = run_turn(engine, prompt_ids, params)
                held.append(engine.prefix_cache.nbytes)
                warmed += engine.warm_next_turn(talks[index], figures.text, prompt_ids, params,
                                                thinking, lambda: False)
                held.append(engine.prefix_cache.nbytes)
                talks[index].append({"role": "assistant", "content": figures.text})
                if turn == 0:
                    first_prompts.append(figures.prompt_tokens)
                else:  # its own first turn was still kept (not evicted)
                    own.append(figures.cached_tokens >= first_prompts[index])
            log(f"memory: after turn {turn + 1} of {conversations} chats: cache "
                f"{held[-1] / MIB:.0f} MiB of {budget / MIB:.0f} MiB, {len(engine.prefix_cache)} entries")
        return {"conversations": conversations, "budget_mib": round(budget / MIB, 1),
                "cache_mib_max": round(max(held) / MIB, 1),
                "within_budget": max(held) <= budget,
                "entries_end": len(engine.prefix_cache), "warmups_stored": warmed,
                "turn2_reused_own": sum(own),
                "rss_growth_mib": round((process.memory_info().rss - rss_start) / MIB, 1)}
    finally:
        engine.prefix_cache = kept


def format_multiturn(record: dict) -> str:
    lines = [f"multi-turn, {record['engine']}: median per turn, prefix cache off -> on"]
    for turn, row in record["turns"]["summary"].items():
        if turn == "bars":
            continue
        lines.append(f"  {turn}: prompt {row['prompt_tokens_on']:.0f} tokens, cached "
                     f"{row['cached_tokens_on']:.0f} (after a pause {row['cached_tokens_pause']:.0f}); "
                     f"ttft {row['ttft_s_off']:.3f}s -> {row['ttft_s_on']:.3f}s (after a pause "
                     f"{row['ttft_s_pause']:.3f}s); end to end {row['end_to_end_s_off']:.2f}s -> "
                     f"{row['end_to_end_s_on']:.2f}s; identical {row['identical']}")
    bars = record["turns"]["summary"].get("bars")
    if bars:
        for mode, words in (("pause", "after a pause, the bars' reading"), ("on", "no pause")):
            lines.append(f"  {words}: turn 2 / turn 1 ttft (worst) "
                         f"{bars[f'ttft_turn2_over_turn1_{mode}_max']}; cached / turn 1 prompt "
                         f"(least) {bars[f'cached_over_turn1_prompt_{mode}_min']}")
    memory = record.get("memory")
    if memory:
        lines.append(f"  memory: {memory['conversations']} interleaved chats, cache at most "
                     f"{memory['cache_mib_max']} MiB of a {memory['budget_mib']} MiB budget; "
                     f"{memory['turn2_reused_own']} second turns found their first turn kept; "
                     f"{memory['warmups_stored']} warm-ups stored an entry")
    return "\n".join(lines)


def write_record(record: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = re.sub(r"[^0-9T]", "", record["created"])[:15]
    path = out_dir / f"multiturn-{record['engine']}-{stamp}.json"
    path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    return path


def run_multiturn(args, target: str, drafter: str, items: list[BenchPrompt],
                  log: Callable[[str], None] | None = None) -> int:
    """`bench --multi-turn`: load, warm up, measure, write the record, print the table."""
    import sys
    from datetime import UTC, datetime

    from dflash_local.bench import machine
    from dflash_local.cli.options import multiturn_options
    from dflash_local.engines import load_engine
    from dflash_local.errors import DFlashError
    from dflash_local.events import AUTO

    log = log or (lambda message: print(message, file=sys.stderr, flush=True))
    if args.conversations < 0:
        raise DFlashError(f"--conversations must be >= 0, got {args.conversations}")
    block_size = args.block_size[0]
    engine = load_engine(args.engine, target, drafter, multiturn_options(args))
    try:
        if block_size == AUTO:
            engine.calibrate(force=args.recalibrate)
        params = GenerationParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                  seed=args.seed, block_size=block_size,
                                  stop_token_ids=tuple(engine.eos_token_ids))
        thinking = None if args.thinking is None else args.thinking == "on"
        run_conversation(engine, items[0], replace(params, max_tokens=16), "pause",
                         thinking=thinking, prefix="warm-up ")  # unrecorded: lazy setup
        record = {
            "schema": "dflash-local-bench-multiturn/2",
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "engine": engine.name, "target": engine.pair.target, "drafter": engine.pair.drafter,
            "dtype": engine.pair.dtype, "threads": engine.compute_threads(),
            "machine": machine.describe(engine.compute_threads()),
            "settings": {"max_tokens": args.max_tokens, "temperature": args.temperature,
                         "block_size": block_size.request_value, "samples": len(items),
                         "budget_mib": round(engine.prefix_cache.budget / MIB, 1)},
            "turns": measure_turns(engine, items, params, thinking, log),
        }
        if args.conversations:
            # short answers: the check is the cache's size, not the decoding
            record["memory"] = measure_memory(
                engine, items, replace(params, max_tokens=min(params.max_tokens, MEMORY_TOKENS)),
                args.conversations, engine.prefix_cache.budget, thinking, log)
    finally:
        engine.close()
    print(format_multiturn(record))
    print(f"record: {write_record(record, args.out)}")
    return 0
