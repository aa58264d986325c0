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

from dflash_local.engines.table import AUTO_ORDER, EngineSpec, engines_of_kind
from dflash_local.errors import EngineUnavailableError


@dataclass(frozen=True)
class PlatformInfo:
    system: str  # platform.system(): "Linux", "Darwin", "Windows"
    machine: str  # platform.machine(): "x86_64", "arm64", "aarch64"
    cuda: bool  # an NVIDIA driver is present
    installed: frozenset[str]  # import names found: a subset of the table's `detect` names

    @property
    def apple_silicon(self) -> bool:
        return self.system == "Darwin" and self.machine == "arm64"


def preference(info: PlatformInfo) -> tuple[str, ...]:
    """Engines in the order `auto` tries them on this kind of machine."""
    return tuple(spec.name for spec in _auto_order(info))


def choose_engine(info: PlatformInfo) -> str:
    """The first engine in `preference(info)` whose package is installed."""
    order = _auto_order(info)
    for spec in order:
        if spec.detect in info.installed:
            return spec.name
    hints = "; or ".join(f"{spec.name}: {spec.install_hint}" for spec in order)
    raise EngineUnavailableError(f"no engine is installed for this machine ({info.system} "
                                 f"{info.machine}, cuda={info.cuda}): {hints}")


def _auto_order(info: PlatformInfo) -> tuple[EngineSpec, ...]:
    machine = "cuda" if info.cuda else "apple_silicon" if info.apple_silicon else "cpu"
    return AUTO_ORDER[machine]


def detect_platform() -> PlatformInfo:
    installed = frozenset(spec.detect for spec in engines_of_kind()
                          if spec.detect and importlib.util.find_spec(spec.detect) is not None)
    return PlatformInfo(system=platform.system(), machine=platform.machine(),
                        cuda=has_nvidia_driver(), installed=installed)


def has_nvidia_driver() -> bool:
    """The driver, not torch: `torch.cuda.is_available()` would import torch just to ask."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return os.path.exists("/proc/driver/nvidia/version") or shutil.which("nvidia-smi") is not None
