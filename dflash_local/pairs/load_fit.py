"""Whether a pair can be loaded here at all, asked before any weight is allocated.

Boundary: a local engine's directories (config.json and the weights' sizes) and the engine's
memory on this machine in; a ModelTooLargeError naming what is needed and what is available
out. The weights are held in the dtype the engine resolved (precision.py), and never counted
below what the config's shapes allocate, whatever the files hold (pair_fit.local_pair_fit). Asked
by LocalEngine's construction, so every command and the service ask it the same way.
"""

from __future__ import annotations

from pathlib import Path

from dflash_local.errors import ModelTooLargeError
from dflash_local.pairs.memory_fit import DTYPE_BYTES, gb
from dflash_local.pairs.pair_fit import ModelFiles, local_pair_fit

LOAD_CONTEXT_TOKENS = 1  # a load is refused only if not even one token of context fits
CPU = "CPU"


def check_load_fits(engine: str, name: str, target_dir: Path, drafter_dir: Path | None,
                    dtype: str, accelerator: bool) -> None:
    """Refuse to load `name` (as callers know it) on a local `engine` whose budget here it
    exceeds, held in `dtype` on the accelerator or the CPU. A directory without a readable
    config.json passes: the loader says what is wrong."""
    target = ModelFiles.read(Path(target_dir))
    if target.config is None:
        return
    where = _memory_here(engine, accelerator)
    if where is None:  # the engine cannot run here: loading it says why
        return
    place, available = where
    drafter = ModelFiles.read(Path(drafter_dir)) if drafter_dir is not None else None
    estimate = local_pair_fit(target, drafter, DTYPE_BYTES[dtype], LOAD_CONTEXT_TOKENS, available)
    if not estimate.fits:
        raise ModelTooLargeError(
            f"{name} does not fit this machine: it needs {gb(estimate.total_bytes)} GB "
            f"({gb(estimate.weights_bytes)} GB of weights in {dtype}), and the {engine} "
            f"engine has {gb(available)} GB available ({place})")


def model_name(given: str, local_dir: Path) -> str:
    """A model as a message names it: a name that is not a path as given, a hub cache snapshot
    by its repo id, another directory by its own name (never a path of this machine)."""
    if not Path(given).is_absolute() and not given.startswith((".", "~")) and given.count("/") <= 1:
        return given
    parts = Path(local_dir).parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].removeprefix("models--").replace("--", "/")
    return Path(local_dir).name


def _memory_here(engine: str, accelerator: bool) -> tuple[str, int] | None:
    """(where the engine runs, the bytes it may use now); RAM as available now on a CPU, since
    the serving pair stays loaded while the new one loads."""
    import psutil

    from dflash_local.pairs.memory_budget import budget_for, machine

    info, memory = machine()
    budget = budget_for(engine, info, memory)
    if not budget.runs_here or budget.budget_bytes is None:
        return None
    if budget.device == CPU or not accelerator:
        return CPU, min(memory.ram_bytes, int(psutil.virtual_memory().available))
    return budget.device, budget.budget_bytes
