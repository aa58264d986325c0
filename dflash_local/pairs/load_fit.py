"""Whether a pair can be loaded here at all, asked before any weight is allocated.

Boundary: a local engine's directories (config.json and the weights' sizes) and the engine's
memory on this machine in; a ModelTooLargeError naming what is needed and what is available
out. The weights are held as the engine will hold them (precision.py), and never counted below
what the config's shapes allocate, whatever the files hold. The arithmetic is memory_fit.py's.
"""

from __future__ import annotations

from pathlib import Path

from dflash_local.errors import ModelTooLargeError
from dflash_local.pairs.catalog import ModelSpec
from dflash_local.pairs.memory_fit import (
    DTYPE_BYTES,
    config_param_count,
    config_quantized,
    estimate_fit,
    gb,
)
from dflash_local.pairs.pair_fit import ModelFiles, held_bytes
from dflash_local.pairs.precision import resolve_dtype

LOAD_CONTEXT_TOKENS = 1  # a load is refused only if not even one token of context fits
CPU = "CPU"


def check_load_fits(engine: str, name: str, target_dir: Path, drafter_dir: Path | None,
                    dtype: str | None = None, device: str | None = None) -> None:
    """Refuse to load `name` (as callers know it) on a local `engine` whose budget here it
    exceeds. A directory without a readable config.json passes: the loader says what is wrong."""
    target = ModelFiles.read(Path(target_dir))
    if target.config is None:
        return
    where = _memory_here(engine, device)
    if where is None:  # the engine cannot run here: loading it says why
        return
    place, available = where
    run_dtype = resolve_dtype(dtype or "auto", accelerator=place != CPU, target_config=target.config)
    run_bytes = DTYPE_BYTES[run_dtype]
    weights = _target_bytes(target, run_bytes)
    drafter = ModelFiles.read(Path(drafter_dir)) if drafter_dir is not None else None
    if drafter is not None:
        weights += held_bytes(_BARE, drafter.stored_bytes, drafter.config, run_bytes) or 0
    estimate = estimate_fit(weights, target.config, LOAD_CONTEXT_TOKENS, available,
                            drafter_config=drafter.config if drafter else None, dtype_bytes=run_bytes)
    if not estimate.fits:
        raise ModelTooLargeError(
            f"{name} does not fit this machine: it needs {gb(estimate.total_bytes)} GB "
            f"({gb(weights)} GB of weights in {run_dtype}), and the {engine} engine has "
            f"{gb(available)} GB available ({place})")


def check_named_pair_fits(engine: str, target: str, drafter: str | None, dtype: str | None = None,
                          device: str | None = None) -> None:
    """check_load_fits for a pair as the commands name it (`auto`, local directories or hub
    repos, downloaded here if they must be, as loading them would), on a local engine."""
    from dflash_local.engines import choose_engine
    from dflash_local.engines.table import LOCAL, kind_of
    from dflash_local.pairs.hub import resolve_model

    engine = choose_engine() if engine == "auto" else engine
    if kind_of(engine) != LOCAL:
        return
    check_load_fits(engine, target, resolve_model(target),
                    resolve_model(drafter) if drafter else None, dtype, device)


_BARE = ModelSpec(repo="local", source="hub")  # a directory: no catalog figures to fall back on


def _target_bytes(files: ModelFiles, run_bytes: int) -> int:
    """The target's weights in memory: the files' bytes converted to the run type, and at least
    what its config's shapes allocate (an engine builds the whole model before reading weights)."""
    stored = held_bytes(_BARE, files.stored_bytes, files.config, run_bytes) or 0
    params = None if config_quantized(files.config) else config_param_count(files.config)
    return max(stored, (params or 0) * run_bytes)


def _memory_here(engine: str, device: str | None) -> tuple[str, int] | None:
    """(where the engine runs, the bytes it may use now); RAM as available now on a CPU, since
    the serving pair stays loaded while the new one loads."""
    import psutil

    from dflash_local.engines.table import METAL, find_engine
    from dflash_local.pairs.memory_budget import budget_for, machine

    info, memory = machine()
    budget = budget_for(engine, info, memory)
    if not budget.runs_here or budget.budget_bytes is None:
        return None
    on_cpu = budget.device == CPU or (find_engine(engine).accelerator != METAL
                                      and device in (None, "cpu"))
    if on_cpu:
        return CPU, min(memory.ram_bytes, int(psutil.virtual_memory().available))
    return budget.device, budget.budget_bytes
