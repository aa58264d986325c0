"""What each engine may use on this machine, and whether it can run here at all.

- MLX with Metal (Apple Silicon): Metal's recommended working set of unified memory
  (`max_recommended_working_set_size`); when MLX cannot say, macOS's default GPU limit, about
  two thirds of RAM up to 36 GB and three quarters above.
- MLX without Metal runs on the CPU: RAM.
- Transformers: the GPU's memory where torch sees CUDA, else RAM.
- vLLM / SGLang: a CUDA GPU's memory; with none here they cannot run on this machine (a remote
  server can still be relayed with `serve --engine openai`).

`budget_for` is pure (a MachineMemory in, an EngineBudget out); `machine_memory` is the one
impure part, asked once per process (it may import mlx or torch, lazily).
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

from dflash_local.engines.selection import PlatformInfo, detect_platform
from dflash_local.engines.table import (
    LAUNCHED,
    LOCAL,
    METAL,
    engine_names,
    engines_of_kind,
    find_engine,
)

SMALL_MAC_BYTES = 36 * 2**30  # macOS lets the GPU wire 2/3 of RAM up to here, 3/4 above


@dataclass(frozen=True)
class MachineMemory:
    ram_bytes: int
    metal_working_set_bytes: int | None = None  # None: no Metal, or MLX could not say
    metal: bool = False  # MLX has a Metal device
    cuda_bytes: int | None = None  # the first CUDA GPU's memory, where torch sees one
    cuda_name: str | None = None


@dataclass(frozen=True)
class EngineBudget:
    engine: str
    runs_here: bool
    device: str  # where it would run: "Metal GPU (unified memory)", "CPU", "CUDA GPU ..."
    budget_bytes: int | None  # what it may use; None where it cannot run here
    note: str  # why it cannot run here, or how the budget was found

    def to_json(self) -> dict:
        return asdict(self)


def metal_default_limit(ram_bytes: int) -> int:
    return ram_bytes * 2 // 3 if ram_bytes <= SMALL_MAC_BYTES else ram_bytes * 3 // 4


def budget_for(engine: str, info: PlatformInfo, memory: MachineMemory) -> EngineBudget:
    spec = find_engine(engine)
    if spec.kind == LAUNCHED and not info.cuda:  # the first reason: installing would not help
        return EngineBudget(engine, False, "-", None,
                            "needs a CUDA GPU (none here); a remote server can be relayed "
                            "with serve --engine openai --base-url URL")
    if spec.detect not in info.installed:
        return EngineBudget(engine, False, "-", None, f"not installed ({spec.install_hint})")
    if spec.kind == LAUNCHED:
        return _cuda_budget(engine, memory)
    if spec.accelerator == METAL:
        if not memory.metal:
            return EngineBudget(engine, True, "CPU", memory.ram_bytes,
                                f"{spec.label} has no Metal device here: it runs on the CPU, "
                                f"within RAM")
        if memory.metal_working_set_bytes:
            return EngineBudget(engine, True, "Metal GPU (unified memory)",
                                memory.metal_working_set_bytes, "Metal's recommended working set")
        return EngineBudget(engine, True, "Metal GPU (unified memory)",
                            metal_default_limit(memory.ram_bytes),
                            "macOS's default GPU limit (2/3 of RAM up to 36 GB, 3/4 above)")
    if info.cuda and memory.cuda_bytes:
        return _cuda_budget(engine, memory)
    return EngineBudget(engine, True, "CPU", memory.ram_bytes, "no CUDA GPU: runs on the CPU, within RAM")


def _cuda_budget(engine: str, memory: MachineMemory) -> EngineBudget:
    if not memory.cuda_bytes:
        return EngineBudget(engine, True, "CUDA GPU", None,
                            "a CUDA driver is present but torch could not report the GPU's memory")
    return EngineBudget(engine, True, f"CUDA GPU {memory.cuda_name or ''}".strip(),
                        memory.cuda_bytes, "the GPU's memory (torch)")


def engine_budgets(engines: tuple[str, ...] | None = None) -> dict[str, EngineBudget]:
    """Each engine's budget (default: every engine that runs on this machine: local, launched)."""
    info, memory = machine()
    engines = engine_names(LOCAL, LAUNCHED) if engines is None else engines
    return {engine: budget_for(engine, info, memory) for engine in engines}


@functools.cache
def machine() -> tuple[PlatformInfo, MachineMemory]:
    info = detect_platform()
    return info, machine_memory(info)


def machine_memory(info: PlatformInfo) -> MachineMemory:
    import psutil

    ram = int(psutil.virtual_memory().total)
    metal, working_set = _metal(info)
    cuda_bytes, cuda_name = _cuda(info)
    return MachineMemory(ram, working_set, metal, cuda_bytes, cuda_name)


def _metal(info: PlatformInfo) -> tuple[bool, int | None]:
    metal_packages = {spec.detect for spec in engines_of_kind(LOCAL) if spec.accelerator == METAL}
    if not info.apple_silicon or not metal_packages & info.installed:
        return False, None
    import mlx.core as mx

    if not mx.metal.is_available():
        return False, None
    device_info = getattr(mx, "device_info", None) or mx.metal.device_info  # moved in MLX 0.29
    size = device_info().get("max_recommended_working_set_size")
    return True, int(size) if size else None


def _cuda(info: PlatformInfo) -> tuple[int | None, str | None]:
    if not info.cuda or "torch" not in info.installed:
        return None, None
    import torch

    if not torch.cuda.is_available():
        return None, None
    properties = torch.cuda.get_device_properties(0)
    return int(properties.total_memory), properties.name
