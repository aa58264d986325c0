"""The machine a benchmark record names: enough to explain why one day's ratios differ from another's.

The CPU model and the vector extensions matmul kernels are chosen by (a wider verify costs
relatively more without AVX-512), the BLAS libraries loaded in this process with the kernel
OpenBLAS picked for this CPU and the one PyTorch dispatches to, the thread counts, and the load
when it was described. Nothing is imported to find out: a framework not loaded is not described,
unless a script whose engine runs in a child process asks (describe_engine).
"""

from __future__ import annotations

import ctypes
import importlib
import os
import sys
from pathlib import Path

from dflash_local import machine_load
from dflash_local.method.calibration import machine_info

VECTOR_FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile",
                "amx_bf16", "asimd", "sve", "sve2", "i8mm", "bf16")
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")
CORENAME_SYMBOLS = ("openblas_get_corename", "openblas_get_corename64_",
                    "scipy_openblas_get_corename", "scipy_openblas_get_corename64_")


def describe(threads: int | None = None) -> dict:
    """The record's "machine": calibration.machine_info() and the rest of this module's list.
    `threads`: the engine's own compute threads, where it knows them."""
    return {**machine_info(), "cpu_flags": cpu_flags(), "blas": blas_libraries(),
            "torch": _torch_kernel(),
            "threads": {"engine": threads, **{name: os.environ.get(name) for name in THREAD_VARIABLES}},
            "load_average": machine_load.load_average()}


def describe_engine(engine: str, threads: int | None = None) -> dict:
    """describe() for a run whose engine works in a child process (a service, a worker): the
    packages its row in the engine table requires are imported here first, so the record names
    the kernels that child dispatches to."""
    from dflash_local.engines.table import find_engine

    spec = find_engine(engine)
    for package in spec.requires if spec is not None else ():
        importlib.import_module(package)
    return describe(threads)


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """The vector extensions of VECTOR_FLAGS this CPU has (Linux: x86 "flags", Arm "Features")."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return []
    for line in text.splitlines():
        if line.lower().startswith(("flags", "features")):
            present = set(line.split(":", 1)[1].split())
            return [flag for flag in VECTOR_FLAGS if flag in present]
    return []


def blas_libraries(maps: Path = Path("/proc/self/maps")) -> list[dict]:
    """Each BLAS library mapped into this process, with the kernel OpenBLAS chose for this CPU."""
    try:
        mapped = {line.split()[-1] for line in maps.read_text().splitlines() if "/" in line}
    except OSError:
        return []
    found = []
    for path in sorted(mapped):
        name = Path(path).name.lower()
        if any(word in name for word in ("blas", "mkl", "accelerate")) and ".so" in name:
            found.append({"library": Path(path).name, "kernel": _openblas_kernel(path)})
    return found


def _openblas_kernel(path: str) -> str | None:
    try:
        library = ctypes.CDLL(path)  # already mapped: this only looks the symbols up
    except OSError:
        return None
    for symbol in CORENAME_SYMBOLS:
        function = getattr(library, symbol, None)
        if function is not None:
            function.restype = ctypes.c_char_p
            return function().decode(errors="replace")
    return None


def _torch_kernel() -> dict | None:
    """PyTorch's CPU kernel level and intra-op threads, when the run loaded PyTorch."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "mkl": torch.backends.mkl.is_available(), "threads": torch.get_num_threads()}
