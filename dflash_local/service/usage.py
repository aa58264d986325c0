"""Our statistics as every API reports them: the `dflash` object of each step, and a reply's
usage (OpenAI's token counts plus the generation's `dflash` totals; the other APIs rename
from it).

Per chunk, `dflash` says what that step committed: `token_ids`, of which the first `accepted`
were drafts the target accepted (the last `copied` of them a prompt-lookup draft's, the others
the drafter's; the rest is the target's bonus/correction token), `drafted` proposals,
the `round` (0 = the prefill's token) and the round's width (`block_size`). The final usage's `dflash`
holds the generation's totals: tau, tokens/s, drafted/accepted, the accepted-per-round histogram;
with tree drafts `drafted` counts every node and `draft_depth` only the longest paths' drafts,
the most that could have been accepted.
"""

from __future__ import annotations

from dflash_local.events import GenerationStats, StepEvent


def step_dflash(event: StepEvent) -> dict:
    return {"token_ids": list(event.token_ids), "drafted": event.drafted,
            "draft_depth": event.draft_depth, "accepted": event.accepted, "accepted_chars": event.accepted_chars,
            "copied": event.lookup_accepted, "copied_chars": event.lookup_accepted_chars,
            "round": event.round_index, "block_size": event.width, "mode": event.mode}


def accepted_histogram(stats: GenerationStats) -> list[int]:
    """Index k = how many rounds committed k tokens (bonus included, as tau counts them)."""
    histogram = [0] * (max(stats.accepted_per_round, default=0) + 1)
    for committed in stats.accepted_per_round:
        histogram[committed] += 1
    return histogram


def reply_usage(stats: GenerationStats, engine: str, block_size: int, speculative: bool,
                auto: bool = False) -> dict:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        # OpenAI's field: the prompt's tokens a kept prefix gave (prefix_cache.py)
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
        "dflash": {
            "tau": round(stats.tau, 4),
            "decode_tokens_per_s": round(stats.decode_tokens_per_s, 2),
            "prefill_tokens_per_s": round(stats.prefill_tokens_per_s, 2),
            "drafted": stats.drafted,
            "draft_depth": stats.draft_depth,
            "accepted": stats.accepted,
            "rounds": stats.rounds,
            "accepted_per_round": accepted_histogram(stats),
            "prefill_s": round(stats.prefill_s, 6),
            "prefill_tokens": stats.prefill_tokens,  # computed; the rest came from the cache
            "cached_tokens": stats.cached_tokens,
            "cached_tier": stats.cached_tier,  # "ram", "disk" (a kept prefix from before a restart) or null
            "decode_s": round(stats.decode_s, 6),
            "engine": engine,
            "block_size": block_size,
            "speculative": speculative,
            "block_policy": "auto" if auto else "fixed",  # auto: block_size is the widest allowed
            "drafter_version": stats.drafter_version,  # an adapted version (adapt/), null: as loaded
        },
    }
