"""What the service sends, as the app uses it: stream chunks, the final usage, and errors.

Kept apart from client.py so the screens can import these without importing httpx: the app
paints its first screen before any HTTP code is loaded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

# a round's `mode` as the service streams it (the names of dflash_local/method/planning/modes.py)
MODE_SPECULATIVE = "speculative"
MODE_FALLBACK = "plain-fallback"  # the block policy chose plain decoding: speculation was losing
MODE_PROBE = "probe"  # one speculative round tried while falling back
MODE_LOOKUP = "lookup"  # the round verified a prompt-lookup draft instead of the drafter's
PHASE_CALIBRATING = "calibrating"  # a load measuring the machine: /dflash/status loading_phase
PHASE_IMPORTING = "importing"  # the first start converting the embedded model from its GGUF
PHASE_LOADING = "loading"  # the weights loading (said as a phase of its own after an import)
# a load's long waits: how often each happens (the status bar), and what it is (a notice)
PHASE_ONCE = {PHASE_IMPORTING: "first start only", PHASE_CALIBRATING: "once per pair"}
PHASE_EXPLAINED = {
    PHASE_IMPORTING: "First start: the embedded model is converted from the GGUF its package "
                     "ships (a few minutes on a CPU). This happens once; later starts skip it.",
    PHASE_CALIBRATING: "Measuring this machine's round costs for {pair}, which choose the draft "
                       "block size (a minute or two). This happens once per pair; the result "
                       "is kept.",
}


class ServiceError(Exception):
    """The service refused or failed a request; `message` is its explanation."""

    def __init__(self, message: str, status: int = 0, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status  # 0 = no HTTP answer (connection refused, reset)
        self.code = code


@dataclass(frozen=True)
class StreamChunk:
    """One streamed step: its text delta and what the round committed."""

    text: str
    token_ids: tuple[int, ...] = ()
    drafted: int = 0
    draft_depth: int = 0  # a tree's longest path (= drafted for a chain): the most it could keep
    accepted: int = 0  # the first `accepted` of token_ids were drafts (the drafter's, then a lookup draft's)
    round: int = 0  # 0 = the prefill's token
    block_size: int = 1  # this round's width (the wire's name, as every field here)
    finish_reason: str | None = None
    accepted_chars: int | None = None  # exact, from the service; None: estimate from the counts
    copied_chars: int | None = None  # of accepted_chars, the last ones a prompt-lookup draft made
    mode: str = MODE_SPECULATIVE
    reasoning: str = ""  # a harmony target's analysis channel (`delta.reasoning_content`)
    received_at: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class StreamUsage:
    prompt_tokens: int
    completion_tokens: int
    dflash: dict  # tau, decode/prefill tokens/s, drafted, accepted, accepted_per_round, engine...
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if sent


def describe_loaded(loaded: dict | None) -> str:
    """`/dflash/status`'s loaded pair in a few words: pair (engine, drafter)."""
    if not loaded:
        return ""
    drafter = Path(loaded["drafter"]).name if loaded.get("drafter") else "no drafter"
    return f"{loaded.get('pair') or loaded['served_name']} ({loaded['engine']}, {drafter})"
