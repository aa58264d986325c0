"""What the speed panel and the race show, computed from the streamed chunks: tokens/s now and
over time, τ, the tokens-per-round histogram, drafted vs accepted; and the race verdict.

Boundary: pure Python, no Textual. Live figures use the client's clock (when each chunk
arrived); when the stream ends, the service's own totals (usage.dflash) replace them.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field, replace

from dflash_chat.adapt_view import served_by
from dflash_chat.protocol import MODE_LOOKUP, MODE_SPECULATIVE, StreamChunk

RATE_WINDOW_S = 1.0  # "tokens/s now" counts the tokens of the last second
SAMPLE_EVERY_S = 0.25  # one sparkline point per quarter second
MAX_SAMPLES = 120


@dataclass(frozen=True)
class SpeedSnapshot:
    speculative: bool = True
    tokens: int = 0
    tokens_per_s_now: float = 0.0
    tokens_per_s: float = 0.0  # decode tokens/s over the whole reply
    samples: tuple[float, ...] = ()
    tau: float = 0.0
    rounds: int = 0
    drafted: int = 0  # every draft verified, a tree's siblings included
    reachable: int = 0  # the drafts a kept path could reach: what acceptance is out of
    accepted: int = 0
    per_round: tuple[tuple[int, int], ...] = ()  # (tokens committed in a round, rounds)
    prefill_s: float | None = None  # time to the first token (the service's)
    block_size: int = 1
    engine: str = ""
    final: bool = False
    plain_rounds: int = 0  # rounds the auto block policy ran plainly (speculation was losing)
    lookup_rounds: int = 0  # rounds that verified a prompt-lookup draft instead of the drafter's
    mode: str = MODE_SPECULATIVE  # the latest round's
    live: bool = False  # a reply is streaming (False and not final: no reply shown)
    ttft_s: float | None = None  # request sent to first token, on the client's clock
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # of prompt_tokens, those a prefix cache served
    cached_tier: str | None = None  # the prefix cache's tier that served them: "ram" or "disk"
    finish_reason: str | None = None  # "length": the reply hit max tokens
    drafter: str = ""  # which drafter served it (adapt_view.served_by); empty: not said

    @property
    def waiting(self) -> bool:
        return self.live and self.tokens == 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.reachable if self.reachable else 0.0


@dataclass
class LiveStats:
    speculative: bool
    tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    reachable: int = 0
    accepted: int = 0
    committed_in_rounds: int = 0
    block_size: int = 1
    mode: str = MODE_SPECULATIVE
    plain_rounds: int = 0
    lookup_rounds: int = 0
    sent_at: float | None = None  # when the request left (for the time to first token)
    finish_reason: str | None = None
    first_token_at: float | None = None
    last_at: float | None = None
    per_round: Counter = field(default_factory=Counter)
    token_ids: list[int] = field(default_factory=list)
    _recent: deque = field(default_factory=deque)  # (arrival time, tokens)
    _samples: deque = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))
    _sample_start: float | None = None
    _sample_tokens: int = 0
    final: dict | None = None  # usage.dflash once the stream has ended

    def add(self, chunk: StreamChunk) -> None:
        count = len(chunk.token_ids)
        self.finish_reason = chunk.finish_reason or self.finish_reason
        self.tokens += count
        self.token_ids.extend(chunk.token_ids)
        self.block_size = chunk.block_size
        if chunk.round > 0:
            self.mode = chunk.mode
            self.plain_rounds += self.speculative and chunk.block_size == 1
            self.lookup_rounds += chunk.mode == MODE_LOOKUP
            self.rounds += 1
            self.drafted += chunk.drafted
            self.reachable += chunk.draft_depth or chunk.drafted  # a chain: every draft
            self.accepted += chunk.accepted
            self.committed_in_rounds += count
            self.per_round[count] += 1
        now = chunk.received_at
        if self.first_token_at is None:
            self.first_token_at = self._sample_start = now
        self.last_at = now
        self._recent.append((now, count))
        while self._recent and now - self._recent[0][0] > RATE_WINDOW_S:
            self._recent.popleft()
        self._sample(now, count)

    def _sample(self, now: float, count: int) -> None:
        assert self._sample_start is not None
        while now - self._sample_start >= SAMPLE_EVERY_S:
            self._samples.append(self._sample_tokens / SAMPLE_EVERY_S)
            self._sample_start += SAMPLE_EVERY_S
            self._sample_tokens = 0
        self._sample_tokens += count

    def finish(self, dflash: dict) -> None:
        self.final = dflash

    def totals(self) -> dict:
        """The reply's figures as usage.dflash names them, plus the client's own (time to
        first token, tokens): what a reply keeps, also one stopped before the service's totals."""
        final = self.final or {
            "speculative": self.speculative, "decode_tokens_per_s": self._rate_overall(),
            "tau": self.tau, "rounds": self.rounds, "drafted": self.drafted,
            "draft_depth": self.reachable, "accepted": self.accepted,
            "block_size": self.block_size,
            "accepted_per_round": [self.per_round.get(k, 0)
                                   for k in range(max(self.per_round, default=0) + 1)]}
        ttft = (self.first_token_at - self.sent_at
                if self.first_token_at is not None and self.sent_at is not None else None)
        return {"speculative": self.speculative, "rounds": self.rounds, **final,
                "completion_tokens": self.tokens, "ttft_s": ttft,
                "finish_reason": self.finish_reason}

    def snapshot(self) -> SpeedSnapshot:
        if self.final:  # "now" is over: the service's totals replace the live figures
            return replace(final_snapshot(self.totals()), samples=tuple(self._samples),
                           plain_rounds=self.plain_rounds, lookup_rounds=self.lookup_rounds,
                           mode=self.mode)
        return SpeedSnapshot(
            speculative=self.speculative, tokens=self.tokens, tokens_per_s_now=self._rate_now(),
            tokens_per_s=self._rate_overall(), samples=tuple(self._samples), tau=self.tau,
            rounds=self.rounds, drafted=self.drafted, reachable=self.reachable,
            accepted=self.accepted, per_round=tuple(sorted(self.per_round.items())),
            block_size=self.block_size, live=True, finish_reason=self.finish_reason,
            plain_rounds=self.plain_rounds, lookup_rounds=self.lookup_rounds, mode=self.mode)

    @property
    def tau(self) -> float:
        return self.committed_in_rounds / self.rounds if self.rounds else 0.0

    def _rate_now(self) -> float:
        """Tokens that arrived in the last RATE_WINDOW_S over that window (early on, the overall
        rate): chunks arrive in bursts, so never a rate between two chunks."""
        if self.first_token_at is None or self.last_at is None:
            return 0.0
        if self.last_at - self.first_token_at < RATE_WINDOW_S:
            return self._rate_overall()
        return sum(count for _, count in self._recent) / RATE_WINDOW_S

    def _rate_overall(self) -> float:
        if self.first_token_at is None or self.last_at is None or self.last_at <= self.first_token_at:
            return 0.0
        return (self.tokens - 1) / (self.last_at - self.first_token_at)


def final_snapshot(totals: dict) -> SpeedSnapshot:
    """A finished reply's figures, from what `LiveStats.totals` kept (stored with the reply)."""
    histogram = totals.get("accepted_per_round", [])
    cached, prompt = totals.get("cached_tokens"), totals.get("prompt_tokens")
    if prompt is None and cached is not None:  # the dflash stats alone: computed + cached
        prompt = totals.get("prefill_tokens", 0) + cached
    return SpeedSnapshot(
        speculative=totals.get("speculative", True), tokens=totals.get("completion_tokens", 0),
        tokens_per_s=totals.get("decode_tokens_per_s", 0.0), tau=totals.get("tau", 0.0),
        rounds=totals.get("rounds", 0), drafted=totals.get("drafted", 0),
        reachable=totals.get("draft_depth", totals.get("drafted", 0)),
        accepted=totals.get("accepted", 0),
        per_round=tuple((k, n) for k, n in enumerate(histogram) if n),
        prefill_s=totals.get("prefill_s"), block_size=totals.get("block_size", 1),
        engine=totals.get("engine", ""), final=True, ttft_s=totals.get("ttft_s"),
        prompt_tokens=prompt, cached_tokens=cached, cached_tier=totals.get("cached_tier"),
        finish_reason=totals.get("finish_reason"), drafter=served_by(totals))


HALF_PRECISION = ("bfloat16", "float16")  # not "server": a served engine's is unknown


@dataclass(frozen=True)
class RaceVerdict:
    identical: bool
    plain_tokens: int
    spec_tokens: int
    first_difference: int | None  # index of the first differing token
    plain_tokens_per_s: float
    spec_tokens_per_s: float
    tau: float
    dtype: str | None = None  # the loaded pair's: in half precision a difference can be rounding

    @property
    def speedup(self) -> float:
        return self.spec_tokens_per_s / self.plain_tokens_per_s if self.plain_tokens_per_s else 0.0

    def summary(self) -> str:
        if self.identical:
            same = f"identical: {self.spec_tokens} tokens, token for token"
        else:
            same = (f"DIFFERENT: first difference at token {self.first_difference} "
                    f"({self.plain_tokens} plain vs {self.spec_tokens} speculative tokens)")
            if self.dtype in HALF_PRECISION:
                same += (f" - in {self.dtype} a verify pass and a plain step round differently; "
                         f"--dtype float32 is exact")
        return (f"{same} | speedup {self.speedup:.2f}x ({self.plain_tokens_per_s:.1f} -> "
                f"{self.spec_tokens_per_s:.1f} tok/s) | tau {self.tau:.2f}")


def race_verdict(plain_ids: list[int], spec_ids: list[int], plain: dict, spec: dict,
                 dtype: str | None = None) -> RaceVerdict:
    """Compare two runs of one prompt: their token ids and their usage.dflash totals."""
    first = next((i for i, (a, b) in enumerate(zip(plain_ids, spec_ids, strict=False)) if a != b),
                 None)
    if first is None and len(plain_ids) != len(spec_ids):
        first = min(len(plain_ids), len(spec_ids))
    return RaceVerdict(identical=first is None, plain_tokens=len(plain_ids),
                       spec_tokens=len(spec_ids), first_difference=first,
                       plain_tokens_per_s=plain.get("decode_tokens_per_s", 0.0),
                       spec_tokens_per_s=spec.get("decode_tokens_per_s", 0.0),
                       tau=spec.get("tau", 0.0), dtype=dtype)
