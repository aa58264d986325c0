"""Engine selection and loading, from the engine table (engines/table.py). Each backend module
is imported only when asked for, so the core (and the service, the TUI's server process, the
CLI's --help) never pays for torch or MLX.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

from dflash_local.engines import table
from dflash_local.engines.table import LAUNCHED, RELAY, EngineSpec
from dflash_local.errors import EngineUnavailableError

if TYPE_CHECKING:
    from dflash_local.engines.base import Engine

__all__ = ["choose_engine", "engine_class_for", "load_engine"]


def choose_engine() -> str:
    """`--engine auto`: MLX first on Apple Silicon, vLLM/SGLang first on CUDA, else Transformers
    (on Linux CPUs torch's kernels beat mlx[cpu]); see engines/selection.py."""
    from dflash_local.engines.selection import choose_engine as choose
    from dflash_local.engines.selection import detect_platform

    return choose(detect_platform())


def load_engine(engine: str, target: str, drafter: str | None, **opts) -> Engine:
    """Resolve the pair's names (local dirs or hub repos) and build the engine.

    opts go to the engine's constructor (dtype, draft_window, device for transformers).
    """
    name = choose_engine() if engine == "auto" else engine
    engine_class = engine_class_for(name)
    kind = table.kind_of(name)
    if kind == RELAY:  # target = the server's base URL
        return engine_class(target, drafter=drafter, **opts)
    if kind == LAUNCHED:  # the server resolves and downloads the models itself
        return engine_class(target, drafter, target_name=target, drafter_name=drafter, **opts)
    from dflash_local.pairs.hub import resolve_model  # a local engine loads local directories

    target_path = resolve_model(target)
    drafter_path = resolve_model(drafter) if drafter else None
    return engine_class(target_path, drafter_path, target_name=target, drafter_name=drafter, **opts)


def engine_class_for(name: str) -> type[Engine]:
    """The engine's class, imported now; a missing package names what to install."""
    spec = table.find_engine(name)
    if spec is None:
        raise EngineUnavailableError(
            f"unknown engine {name!r} (known: auto, {', '.join(table.engine_names())})")
    missing = _missing_packages(spec)
    if missing:
        raise EngineUnavailableError(
            f"the {name} engine needs {', '.join(missing)}, which is not installed: "
            f"{spec.install_hint}"
        )
    if spec.before_import is not None:
        hook_module, _, hook = spec.before_import.partition(":")
        getattr(importlib.import_module(hook_module), hook)()
    try:
        module = importlib.import_module(spec.module)
    except ModuleNotFoundError as exc:
        if exc.name == spec.module:
            raise EngineUnavailableError(f"the {name} engine is not part of this build") from None
        raise EngineUnavailableError(
            f"the {name} engine cannot import {exc.name}: {spec.install_hint}"
        ) from None
    return getattr(module, spec.class_name)


def _missing_packages(spec: EngineSpec) -> list[str]:
    return [package for package in spec.requires if importlib.util.find_spec(package) is None]
