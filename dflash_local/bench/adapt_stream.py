"""`dflash-local bench --adapt-stream`: does the drafter learn its user's traffic, and at what
cost to the requests that arrive while it learns?

Per kind of use (adapt_kinds.py), a fresh service (adapt_service.py) serves the kind's stream as
a user would (speculative, recorded); at each checkpoint (after 0, 25, 50, 100, 200 replies) it
waits until adaptation has caught up (`adapt.pending == 0 and not adapt.training`), then measures
the kind's held-out prompts speculative and plain in the same run (τ, decode speedup, identical
output), and the general held-out set's τ (forgetting). While it waits, short probe requests
arrive and their time to first token is set against the same probes' when the service is idle.
Held-out prompts and probes are sent with `store: false`: never recorded, never trained on.

A service without adaptation (no `adapt.training` / `adapt.pending` in its status) is measured
all the same and the record says "adaptation absent": its checkpoints are the shipped drafter's.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from dflash_local.bench.adapt_kinds import AdaptPrompt, KindSet, as_text
from dflash_local.bench.adapt_service import (
    POLL_S,
    Reply,
    RequestRefused,
    ServiceClient,
    ServiceRun,
)
from dflash_local.errors import DFlashError

CHECKPOINTS = (0, 25, 50, 100, 200)
PROBE = AdaptPrompt("probe", ({"role": "user", "content": "Say hello in one short sentence."},))
PROBE_TOKENS = 4  # a probe's time to first token is what counts, not its reply


@dataclass(frozen=True)
class StreamSettings:
    checkpoints: tuple[int, ...] = CHECKPOINTS  # replies served before each measurement
    max_tokens: int = 128
    ttft_arrivals: int = 50  # probes during training, and as many while idle
    catch_up_timeout_s: float = 3600.0
    serve_args: tuple[str, ...] = ()  # the engine and pair `serve` loads


@dataclass
class Probes:
    """Times to first token of probe requests: while the service trains, and while idle."""

    during_training: list[float] = field(default_factory=list)
    idle: list[float] = field(default_factory=list)


def adaptation_present(status: dict) -> bool:
    adapt = status.get("adapt")
    # `enabled` false: the service records (or not) but trains nothing (serve --no-adapt, a served
    # engine, training while idle off): its checkpoints are the shipped drafter's
    return isinstance(adapt, dict) and adapt.get("enabled") is True and "pending" in adapt


def caught_up(status: dict) -> bool:
    adapt = status["adapt"]
    return adapt.get("pending") == 0 and not adapt.get("training")


def catch_up(service: ServiceClient, probes: Probes, settings: StreamSettings) -> float:
    """Seconds until adaptation caught up; while it trains, probes arrive (one at a time)."""
    started = time.monotonic()
    while True:
        status = service.status()
        if caught_up(status):
            return time.monotonic() - started
        if time.monotonic() - started > settings.catch_up_timeout_s:
            raise DFlashError(f"adaptation did not catch up within {settings.catch_up_timeout_s:.0f}"
                              f" s (status adapt: {status['adapt']})")
        if status["adapt"].get("training") and len(probes.during_training) < settings.ttft_arrivals:
            probes.during_training.append(_probe(service))
        else:
            time.sleep(POLL_S)


def _probe(service: ServiceClient) -> float:
    return service.reply(PROBE.request_fields(), speculative=True, max_tokens=PROBE_TOKENS,
                         store=False).ttft_s


def held_out_figures(service: ServiceClient, prompts: tuple[AdaptPrompt, ...], max_tokens: int,
                     plain: bool = True) -> dict:
    """τ over the prompts' speculative replies; with `plain`, the decode speedup over plain
    decoding of the same prompts (interleaved: plain, then speculative, per prompt) and whether
    every reply was the plain one token for token."""
    speculative, baseline = [], []
    for prompt in prompts:
        fields = prompt.request_fields()
        if plain:
            baseline.append(service.reply(fields, speculative=False, max_tokens=max_tokens,
                                          store=False))
        speculative.append(service.reply(fields, speculative=True, max_tokens=max_tokens,
                                         store=False))
    figures = {"tau": statistics.fmean(r.tau for r in speculative),
               "versions": sorted({r.drafter_version for r in speculative}, key=str)}
    if plain:
        figures["speedup"] = _rate(speculative) / _rate(baseline)
        figures["identical"] = all(s.token_ids == b.token_ids
                                   for s, b in zip(speculative, baseline, strict=True))
    return figures


def _rate(replies: list[Reply]) -> float:
    """Decode tokens per second over the replies together (their decode times summed)."""
    seconds = sum(r.completion_tokens / r.tokens_per_s for r in replies if r.tokens_per_s)
    return sum(r.completion_tokens for r in replies) / seconds if seconds else 0.0


def measure_kind(service: ServiceClient, kind_set: KindSet, general: tuple[AdaptPrompt, ...],
                 settings: StreamSettings) -> dict:
    """The kind's checkpoints, its probes and whether the service adapts at all."""
    present = adaptation_present(service.status())
    probes, points, served = Probes(), [], 0
    for checkpoint in settings.checkpoints:
        if checkpoint > len(kind_set.stream):
            points.append({"replies": checkpoint, "missing": f"the kind has {len(kind_set.stream)}"
                                                             f" stream prompts"})
            continue
        for prompt in kind_set.stream[served:checkpoint]:  # recorded, as a user's replies are
            service.reply(prompt.request_fields(), speculative=True,
                          max_tokens=settings.max_tokens, store=True)
        served = checkpoint
        point = {"replies": checkpoint,
                 "caught_up_s": catch_up(service, probes, settings) if present else None,
                 **held_out_figures(service, kind_set.held_out, settings.max_tokens)}
        if kind_set.kind != "general":
            point["general_tau"] = held_out_figures(service, general, settings.max_tokens,
                                                    plain=False)["tau"]
        point["adapt"] = service.status().get("adapt")
        points.append(point)
    probes.idle = [_probe(service) for _ in range(settings.ttft_arrivals)]
    return {"kind": kind_set.kind, "source": kind_set.source, "adaptation": present,
            "stream": len(kind_set.stream), "held_out": len(kind_set.held_out),
            "points": points, "ttft": {"during_training": probes.during_training,
                                       "idle": probes.idle}}


def servable(service: ServiceClient, kind_set: KindSet) -> KindSet:
    """The kind as this pair can take it: an agent's tools as text where its template has
    none (asked once, with a one-token request that is not recorded)."""
    first = kind_set.held_out[0]
    if not first.tools:
        return kind_set
    try:
        service.reply(first.request_fields(), speculative=False, max_tokens=1, store=False)
    except RequestRefused as refused:
        if refused.status != 400 or "tools" not in refused.service_message:
            raise
        return as_text(kind_set)
    return kind_set


def run_kinds(sets: dict[str, KindSet], kinds: tuple[str, ...], settings: StreamSettings,
              homes: Path) -> list[dict]:
    """Each kind on a service of its own, started from the shipped drafter."""
    results = []
    for kind in kinds:
        with ServiceRun(list(settings.serve_args), homes / kind) as service:
            service.wait_loaded()
            print(f"{kind}: serving {len(sets[kind].stream)} stream prompts on {service.url}",
                  flush=True)
            kind_set = servable(service, sets[kind])
            results.append(measure_kind(service, kind_set, sets["general"].held_out, settings))
    return results
