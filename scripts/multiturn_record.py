"""Turn `dflash-local bench --multi-turn` outputs (one JSON per engine) into the two records
docs/records/ keeps: time to first token and end to end per turn, the prefix cache off, on with
no pause and on after a pause, and the cache's memory under interleaved chats (runs made with
--conversations 0 leave that record as it is). The figures are copied, never recomputed.

    .venv/bin/python scripts/multiturn_record.py bench-results/multiturn-*.json
    .venv/bin/python scripts/render_benchmarks.py
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from dflash_local.bench.report import write_record

ROOT = Path(__file__).resolve().parent.parent
ENGINES = {"transformers": "Transformers", "mlx": "MLX"}
COMMAND = ("dflash-local bench --multi-turn --engine {engine} --max-samples 4 --max-tokens 128 "
           "--conversations {conversations}")
MEMORY_COMMAND = ("dflash-local bench --multi-turn --engine {engine} --max-samples 1 --max-tokens 64 "
                  "--conversations 20 --prefix-cache-mb {budget}")
MEMORY_NOTE = ("The default budget is 64K tokens of the pair's cache, at most 1/8 of the machine's "
               "memory (23 GiB here, so 1/8). A smaller budget evicts the least recently used "
               "conversations whole: their second turns reuse only what they share with a kept "
               "one (the chat template's opening).")
NOISE = ("The machine was shared while these ran (load average {load} on 2 cores), so every time "
         "here is noisy; the three ways rotate which goes first per conversation to spread the "
         "noise over all.")


def turn_rows(raw: dict) -> list[dict]:
    """Per turn: the medians off, on (no pause) and after a pause; on turn 2 the bars' ratios."""
    name = ENGINES[raw["engine"]]
    summary = raw["turns"]["summary"]
    samples = raw["turns"]["samples"]
    rows = []
    for turn in ("turn 1", "turn 2"):
        row = summary[turn]
        identical = sum(s["turns"][int(turn[-1]) - 1]["identical"] for s in samples)
        rows.append({"label": f"{name}, {turn}", "bold": turn == "turn 2",
                     "prompt": round(row["prompt_tokens_on"]), "cached": round(row["cached_tokens_on"]),
                     "cached_pause": round(row["cached_tokens_pause"]),
                     "ttft_off": round(row["ttft_s_off"], 2), "ttft_on": round(row["ttft_s_on"], 2),
                     "ttft_pause": round(row["ttft_s_pause"], 2),
                     "e2e_off": round(row["end_to_end_s_off"], 1),
                     "e2e_pause": round(row["end_to_end_s_pause"], 1),
                     "identical": f"{identical}/{len(samples)}"})
    rows[0]["warm"] = round(summary["turn 1"]["warm_s_pause"], 2)
    bars = summary["bars"]
    first = statistics.median(s["turns"][0]["pause"]["ttft_s"] for s in samples)
    rows[-1]["ratio"] = round(summary["turn 2"]["ttft_s_pause"] / first, 2)
    rows[-1]["worst_ratio"] = round(bars["ttft_turn2_over_turn1_pause_max"], 2)
    rows[-1]["worst_ratio_on"] = round(bars["ttft_turn2_over_turn1_on_max"], 2)
    return rows


def memory_row(raw: dict) -> dict:
    memory = raw["memory"]
    return {"label": f"{ENGINES[raw['engine']]}, {memory['budget_mib']:.0f} MiB budget",
            "chats": memory["conversations"],
            "budget": memory["budget_mib"], "held": memory["cache_mib_max"],
            "within": "yes" if memory["within_budget"] else "NO",
            "reused": _reused_own(memory),
            "warmed": _warmed(memory),
            "entries": memory["entries_end"], "rss": memory["rss_growth_mib"]}


def _warmed(memory: dict) -> str:
    """The replies whose next turn a warm-up stored; runs made before the memory check warmed
    next turns warmed none."""
    if "warmups_stored" not in memory:
        return "none (not warmed)"
    return f"{memory['warmups_stored']}/{2 * memory['conversations']}"


def _reused_own(memory: dict) -> str:
    """Second turns that found their own first turn kept. Runs made before the bench counted
    it: where the cache never came near its budget nothing was evicted, so every one did."""
    count = memory["conversations"]
    if "turn2_reused_own" in memory:
        return f"{memory['turn2_reused_own']}/{count}"
    if memory["cache_mib_max"] < memory["budget_mib"] / 2:
        return f"{count}/{count} (nothing evicted)"
    return "not counted"


def common(raws: list[dict], extra: list[dict] = ()) -> dict:
    first = raws[0]
    return {
        "command": [COMMAND.format(engine=raw["engine"],
                                   conversations=(raw.get("memory") or {}).get("conversations", 0))
                    for raw in raws]
        + [MEMORY_COMMAND.format(engine=raw["engine"], budget=round(raw["settings"]["budget_mib"]))
           for raw in extra],
        "date": first["created"][:10],
        "engine": ", ".join(raw["engine"] for raw in raws),
        "settings": {"pair": "embedded (SmolLM2-135M-Instruct + smollm2-135m-dflash)",
                     "dtype": first["dtype"], "temperature": 0,
                     "max_tokens": first["settings"]["max_tokens"],
                     "block_size": first["settings"]["block_size"],
                     "prefix_cache": f"default budget, {first['settings']['budget_mib']:.0f} MiB"},
        "source": "dflash_local/bench/multiturn.py, scripts/multiturn_record.py",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", nargs="+", type=Path)
    parser.add_argument("--memory", nargs="*", type=Path, default=[],
                        help="more runs whose memory check alone is kept (another budget)")
    parser.add_argument("--notes", nargs="*", default=[], help="more notes for the turns record")
    parser.add_argument("--load", default="unknown", help="the load average while the runs ran")
    args = parser.parse_args(argv)
    raws = [json.loads(path.read_text()) for path in args.raw]
    more = [json.loads(path.read_text()) for path in args.memory]
    turns = {
        "title": "Multi-turn chat with the prefix cache: time to first token per turn",
        "measured": (
            "Four two-turn conversations of the repo's own set (bench/data/multiturn.jsonl: a "
            "600-700 token passage and question, then a short follow-up that sees the reply), "
            "each run three ways: the prefix cache off; on, the next turn sent the moment the "
            "reply ends (no warm-up); on after a pause, a user's reading time, in which the idle "
            "service warms the next turn (engines/turn_warmup.py; here run to its end between "
            "the turns; warm-up: its time, the reading time it needs). Medians over the "
            "conversations: prompt and cached tokens, time to first token (ttft: request to the "
            "first token, a restore included) and end to end, in seconds; turn 2 / turn 1: the "
            "turn 2 ttft over the turn 1 ttft after a pause (the medians', and the worst "
            "conversation's), and the worst with no pause; identical: the "
            "answers of all three, token for token."),
        "dataset": "multiturn (4 two-turn conversations, MT-Bench's question format)",
        "row_header": "4 conversations", **common(raws),
        "columns": [
            {"key": "prompt", "label": "prompt tokens", "decimals": 0},
            {"key": "cached", "label": "cached, no pause", "decimals": 0},
            {"key": "cached_pause", "label": "cached after a pause", "decimals": 0},
            {"key": "ttft_off", "label": "ttft off (s)", "decimals": 2},
            {"key": "ttft_on", "label": "ttft no pause (s)", "decimals": 2},
            {"key": "ttft_pause", "label": "ttft after a pause (s)", "decimals": 2},
            {"key": "ratio", "label": "turn 2 / turn 1", "decimals": 2},
            {"key": "worst_ratio", "label": "worst", "decimals": 2},
            {"key": "worst_ratio_on", "label": "worst, no pause", "decimals": 2},
            {"key": "warm", "label": "warm-up (s)", "decimals": 2},
            {"key": "e2e_off", "label": "end to end off (s)", "decimals": 1},
            {"key": "e2e_pause", "label": "end to end after a pause (s)", "decimals": 1},
            {"key": "identical", "label": "identical"}],
        "rows": [row for raw in raws for row in turn_rows(raw)],
        "notes": [NOISE.format(load=args.load), *args.notes],
    }
    memory_common = common(raws, more)
    memory_common["settings"] = {key: value for key, value in memory_common["settings"].items()
                                 if key != "prefix_cache"} | {"max_tokens": 64}
    memory = {
        "title": "The prefix cache's memory under 20 interleaved conversations",
        "measured": (
            "20 two-turn conversations interleaved (every first turn, then every second), "
            "answers of at most 64 tokens, through the default budget and a 256 MiB one, each "
            "reply's next turn warmed after it as the idle service warms it: the largest the cache "
            "held (MiB, the arrays' own bytes), whether that stayed within the budget, how many "
            "second turns found their own first turn still kept, how many warm-ups stored an "
            "entry, the entries left, and the process's RSS growth."),
        "dataset": "multiturn, cycled with a distinct opening per conversation",
        "row_header": "20 chats", **memory_common,
        "columns": [
            {"key": "budget", "label": "budget (MiB)", "decimals": 0},
            {"key": "held", "label": "held at most (MiB)", "decimals": 1},
            {"key": "within", "label": "within budget"},
            {"key": "reused", "label": "turn 2 found its turn 1"},
            {"key": "warmed", "label": "next turns warmed"},
            {"key": "entries", "label": "entries at the end", "decimals": 0},
            {"key": "rss", "label": "RSS growth (MiB)", "decimals": 1}],
        "rows": [memory_row(raw) for raw in raws + more if "memory" in raw],
        "notes": [MEMORY_NOTE],
    }
    out = ROOT / "docs" / "records"
    machine = raws[0]["machine"]  # the bench runs described it as they started
    write_record(out / "prefix-cache-multiturn.json", turns, machine=machine, setting="a virtual machine")
    if memory["rows"]:  # runs with --conversations 0 leave the memory record as it is
        write_record(out / "prefix-cache-memory.json", memory, machine=machine, setting="a virtual machine")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
