"""`--engine auto`: which backend to run, as a pure function of what the machine has.

`choose_engine(platform_info)` decides; `detect_platform()` is the one impure part (it looks for
packages and an NVIDIA driver without importing torch, so asking stays cheap). Named `selection`
rather than `select` so that running a file in this folder never shadows the stdlib module.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
from dataclasses import dataclass

from dflash_local.errors import EngineUnavailableError

# the import name that makes each engine usable
ENGINE_PACKAGES = {"vllm": "vllm", "sglang": "sglang", "transformers": "torch", "mlx": "mlx"}
INSTALL_HINTS = {
    "vllm": "pip install 'dflash-local[vllm]'",
    "sglang": "pip install 'dflash-local[sglang]'",
    "transformers": "pip install 'dflash-local[torch]'",
    "mlx": "pip install mlx mlx-lm (Apple Silicon) or pip install 'mlx[cpu]' mlx-lm (Linux)",
}


@dataclass(frozen=True)
class PlatformInfo:
    system: str  # platform.system(): "Linux", "Darwin", "Windows"
    machine: str  # platform.machine(): "x86_64", "arm64", "aarch64"
    cuda: bool  # an NVIDIA driver is present
    installed: frozenset[str]  # import names found: a subset of ENGINE_PACKAGES' values

    @property
    def apple_silicon(self) -> bool:
        return self.system == "Darwin" and self.machine == "arm64"


def preference(info: PlatformInfo) -> tuple[str, ...]:
    """Engines in the order `auto` tries them on this kind of machine."""
    if info.cuda:  # the served engines are the fast path on a GPU; vLLM first
        return ("vllm", "sglang", "transformers", "mlx")
    if info.apple_silicon:
        return ("mlx", "transformers")
    return ("transformers", "mlx")  # CPU: vLLM/SGLang CPU builds exist but are not the default


def choose_engine(info: PlatformInfo) -> str:
    """The first engine in `preference(info)` whose package is installed."""
    order = preference(info)
    for engine in order:
        if ENGINE_PACKAGES[engine] in info.installed:
            return engine
    hints = "; or ".join(f"{engine}: {INSTALL_HINTS[engine]}" for engine in order)
    raise EngineUnavailableError(f"no engine is installed for this machine ({info.system} "
                                 f"{info.machine}, cuda={info.cuda}): {hints}")


def detect_platform() -> PlatformInfo:
    installed = frozenset(name for name in ENGINE_PACKAGES.values()
                          if importlib.util.find_spec(name) is not None)
    return PlatformInfo(system=platform.system(), machine=platform.machine(),
                        cuda=has_nvidia_driver(), installed=installed)


def has_nvidia_driver() -> bool:
    """The driver, not torch: `torch.cuda.is_available()` would import torch just to ask."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return os.path.exists("/proc/driver/nvidia/version") or shutil.which("nvidia-smi") is not None
