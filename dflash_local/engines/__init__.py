"""Engine selection and loading. Each backend module is imported only when asked for, so the
core (and the service, the TUI's server process, the CLI's --help) never pays for torch or MLX.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

from dflash_local.engines.interface import Engine
from dflash_local.engines.options import ENGINE_DEFAULTS, LAUNCHED, LOCAL, RELAY, EngineOptions
from dflash_local.errors import EngineUnavailableError
from dflash_local.pairs.hub import resolve_model

__all__ = ["ENGINES", "Engine", "choose_engine", "load_engine"]
SERVED_ENGINES = ("vllm", "sglang")


@dataclass(frozen=True)
class EngineSpec:
    module: str  # dflash_local.engines.<module>
    class_name: str
    packages: tuple[str, ...]  # import names the backend needs
    install_hint: str
    before_import: Callable[[], object] | None = None  # an install that must precede the module


def _install_fast_blas() -> None:
    """MLX binds its BLAS when mlx.core is first imported: the fast one must be loaded before.
    The handle is dropped on purpose: once libmlx binds to it, it is MLX's for the process."""
    from dflash_local.accel import blas

    blas.install()


def _install_omp_passive() -> None:
    """OpenMP reads its wait policy when torch loads it: set before torch is imported."""
    from dflash_local.accel import omp

    omp.install()


ENGINES = {
    "transformers": EngineSpec(
        "torch_engine", "TorchEngine", ("torch", "transformers"),
        "pip install 'dflash-local[torch]'", _install_omp_passive,
    ),
    # served engines: the package may live in another venv, so the engine checks it itself
    "vllm": EngineSpec("vllm_engine", "VLLMEngine", (), "pip install 'dflash-local[vllm]'"),
    "sglang": EngineSpec("sglang_engine", "SGLangEngine", (), "pip install 'dflash-local[sglang]'"),
    "mlx": EngineSpec(
        "mlx_engine", "MLXEngine", ("mlx", "mlx_lm"),
        "pip install mlx mlx-lm (Apple Silicon) or pip install 'mlx[cpu]' mlx-lm (Linux)",
        _install_fast_blas,
    ),
}


def choose_engine() -> str:
    """`--engine auto`: MLX first on Apple Silicon, vLLM/SGLang first on CUDA, else Transformers
    (on Linux CPUs torch's kernels beat mlx[cpu]); see engines/selection.py."""
    from dflash_local.engines.selection import choose_engine as choose
    from dflash_local.engines.selection import detect_platform

    return choose(detect_platform())


def load_engine(engine: str, target: str, drafter: str | None,
                options: EngineOptions = ENGINE_DEFAULTS) -> Engine:
    """Resolve the pair's names (local dirs or hub repos) and build the engine with the
    `options` given (engines/options.py); one it cannot honour is refused."""
    name = choose_engine() if engine == "auto" else engine
    if name == "openai":  # target = the server's base URL
        from dflash_local.engines.openai_engine import RemoteEngine

        return RemoteEngine(target, drafter=drafter, **options.keywords(name, RELAY))
    engine_class = engine_class_for(name)
    if name in SERVED_ENGINES:  # the server resolves and downloads the models itself
        return engine_class(target, drafter, target_name=target, drafter_name=drafter,
                            **options.keywords(name, LAUNCHED))
    keywords = options.keywords(name, LOCAL)
    target_path = resolve_model(target)
    drafter_path = resolve_model(drafter) if drafter else None
    return engine_class(target_path, drafter_path, target_name=target, drafter_name=drafter,
                        **keywords)


def engine_class_for(name: str) -> type[Engine]:
    """The engine's class, imported now; a missing package names what to install."""
    spec = ENGINES.get(name)
    if spec is None:
        raise EngineUnavailableError(f"unknown engine {name!r} (known: auto, {', '.join(ENGINES)})")
    missing = _missing_packages(spec)
    if missing:
        raise EngineUnavailableError(
            f"the {name} engine needs {', '.join(missing)}, which is not installed: "
            f"{spec.install_hint}"
        )
    module_name = f"dflash_local.engines.{spec.module}"
    if spec.before_import is not None:
        spec.before_import()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            raise EngineUnavailableError(f"the {name} engine is not part of this build") from None
        raise EngineUnavailableError(
            f"the {name} engine cannot import {exc.name}: {spec.install_hint}"
        ) from None
    return getattr(module, spec.class_name)


def _missing_packages(spec: EngineSpec) -> list[str]:
    return [package for package in spec.packages if importlib.util.find_spec(package) is None]
