"""Timed runs and their summaries: ours (engine.stream, plain = speculative off) and the peers.

One definition of speed for everyone: decode tokens/s = (completion tokens - 1) / time from the
first generated token to the last (the first token belongs to the prefill); prefill tokens/s =
prompt tokens / time to the first token. τ = tokens committed per round after the prefill.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field, replace

from dflash_local.events import GenerationParams, GenerationStats, decode_rate, prefill_rate


@dataclass
class RunFigures:
    """One timed generation of one method on one prompt."""

    prompt_tokens: int
    completion_tokens: int
    prefill_s: float
    decode_s: float
    committed_per_round: list[int] = field(default_factory=list)  # empty = not observable
    widths: list[int] = field(default_factory=list)  # block width per round (ours)
    modes: list[str] = field(default_factory=list)  # mode per round (ours)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    repeat_decode_s: list[float] = field(default_factory=list)  # every try, when repeated
    # a served engine whose rounds are known by totals only (Prometheus counters): its server's
    # {"source", "rounds", "accepted"}; τ comes from them where committed_per_round is empty
    server_acceptance: dict | None = None
    constraint_s: float = 0.0  # the output constraint's time in this run (masks, matcher)

    @property
    def decode_tokens_per_s(self) -> float:
        return decode_rate(self.completion_tokens, self.decode_s)

    @property
    def prefill_tokens_per_s(self) -> float:
        return prefill_rate(self.prompt_tokens, self.prefill_s)

    @property
    def tau(self) -> float | None:
        rounds = self.committed_per_round
        if rounds:
            return sum(rounds) / len(rounds)
        return server_tau([self.server_acceptance] if self.server_acceptance else [])

    def to_json(self) -> dict:
        record = {
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "prefill_s": round(self.prefill_s, 5), "decode_s": round(self.decode_s, 5),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 3),
            "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 2),
        }
        if self.tau is not None:
            record["tau"] = round(self.tau, 4)
        if self.committed_per_round:
            record["committed_per_round"] = self.committed_per_round
        if self.server_acceptance:
            record["server_acceptance"] = self.server_acceptance
        if self.repeat_decode_s:
            record["decode_s_repeats"] = [round(s, 5) for s in self.repeat_decode_s]
        if self.constraint_s:
            record["constraint_s"] = round(self.constraint_s, 5)
        if self.widths:
            record["widths"] = self.widths
            record["rounds_by_mode"] = dict(Counter(self.modes))
        return record


def run_ours(engine, prompt_ids: list[int], params: GenerationParams) -> RunFigures:
    """One generation through engine.stream; plain when params.speculative is False."""
    stats = GenerationStats()
    token_ids: list[int] = []
    pieces: list[str] = []
    widths: list[int] = []
    modes: list[str] = []
    constraint_s = 0.0
    for event in engine.stream(prompt_ids, params):
        stats.add(event)
        constraint_s = event.constraint_s
        token_ids.extend(event.token_ids)
        pieces.append(event.text)
        if event.round_index:
            widths.append(event.width)
            modes.append(event.mode)
    return RunFigures(
        prompt_tokens=len(prompt_ids), completion_tokens=stats.completion_tokens,
        prefill_s=stats.prefill_s, decode_s=stats.decode_s,
        committed_per_round=stats.accepted_per_round if params.speculative else [],
        widths=widths if params.speculative else [], modes=modes if params.speculative else [],
        token_ids=token_ids, text="".join(pieces), constraint_s=constraint_s,
    )


def run_served(engine, messages: list[dict], params: GenerationParams,
               thinking: bool | None) -> RunFigures:
    """One generation from a served engine (our service, vLLM, SGLang, any OpenAI server): the
    server tokenizes and templates; acceptance is the server's own (our service's per-round
    `dflash` stats, else its metrics: per round where they agree with the stream, else totals)."""
    token_ids: list[int] = []
    pieces: list[str] = []
    widths: list[int] = []
    modes: list[str] = []
    per_round: list[int] = []
    for event in engine.stream_chat(messages, params, thinking):
        token_ids.extend(event.token_ids)
        pieces.append(event.text)
        if event.round_index:
            per_round.append(len(event.token_ids))
            widths.append(event.width)
            modes.append(event.mode)
    server = engine.last_stats
    speculative = params.speculative and server.source != "none"
    return RunFigures(
        prompt_tokens=server.prompt_tokens, completion_tokens=server.completion_tokens,
        prefill_s=server.ttft_s, decode_s=server.decode_s,
        committed_per_round=per_round if speculative and server.per_round_exact else [],
        widths=widths if speculative else [], modes=modes if speculative else [],
        token_ids=token_ids, text="".join(pieces),
        server_acceptance={"source": server.source, "rounds": server.rounds,
                           "accepted": server.accepted} if speculative else None,
    )


def fastest(runs: list[RunFigures]) -> RunFigures:
    """The try with the shortest decode, with every try's decode time: on a shared machine
    noise only ever adds time, so the fastest of a few tries is the closest to the method's own."""
    best = min(runs, key=lambda run: run.decode_s)
    return replace(best, repeat_decode_s=[run.decode_s for run in runs]) if len(runs) > 1 else best


def summarize(runs: list[RunFigures], baseline: list[RunFigures], max_width: int = 0) -> dict:
    """Totals over a dataset's samples for one method, against the plain runs of the same samples."""
    produced = sum(max(run.completion_tokens - 1, 0) for run in runs)
    decode_s = sum(run.decode_s for run in runs)
    prefill_s = sum(run.prefill_s for run in runs)
    speed = produced / decode_s if decode_s > 0 else 0.0
    base_produced = sum(max(run.completion_tokens - 1, 0) for run in baseline)
    base_s = sum(run.decode_s for run in baseline)
    base_speed = base_produced / base_s if base_s > 0 else 0.0
    ratios = [run.decode_tokens_per_s / base.decode_tokens_per_s
              for run, base in zip(runs, baseline) if base.decode_tokens_per_s > 0]
    summary = {
        "samples": len(runs), "completion_tokens": sum(run.completion_tokens for run in runs),
        "decode_tokens_per_s": round(speed, 3),
        "prefill_tokens_per_s": round(prefill_rate(sum(r.prompt_tokens for r in runs), prefill_s), 2),
        "speedup": round(speed / base_speed, 4) if base_speed > 0 else None,
        "median_sample_speedup": round(statistics.median(ratios), 4) if ratios else None,
    }
    rounds = [count for run in runs for count in run.committed_per_round]
    served = [run.server_acceptance for run in runs if run.server_acceptance]
    if rounds:
        summary["tau"] = round(sum(rounds) / len(rounds), 4)
        summary["acceptance_histogram"] = histogram(rounds, max_width or max(rounds))
    elif server_tau(served) is not None:  # the server's totals only
        summary["tau"] = round(server_tau(served), 4)
    if served:
        summary["acceptance_source"] = served[0]["source"]
    constraint_s = sum(run.constraint_s for run in runs)
    if constraint_s:  # the constraint's cost per generated token, prefill's token included
        summary["constraint_us_per_token"] = round(1e6 * constraint_s / summary["completion_tokens"], 1)
    modes = Counter(mode for run in runs for mode in run.modes)
    if modes:
        summary["rounds_by_mode"] = dict(modes)
        summary["mean_width"] = round(statistics.fmean(w for r in runs for w in r.widths), 3)
    return summary


def server_tau(served: list[dict]) -> float | None:
    """τ from a server's acceptance totals (rounds, drafts accepted); None without a round."""
    rounds = sum(s["rounds"] for s in served)
    return 1 + sum(s["accepted"] for s in served) / rounds if rounds else None


def histogram(committed_per_round: list[int], max_width: int) -> list[int]:
    """counts[k-1] = rounds that committed k tokens, k = 1..max_width."""
    counts = Counter(committed_per_round)
    return [counts.get(k, 0) for k in range(1, max(max_width, max(counts, default=1)) + 1)]
