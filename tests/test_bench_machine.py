"""What a benchmark record says of the machine (bench/machine.py): the vector extensions, the
BLAS libraries in the process with the kernel OpenBLAS chose, and nothing it cannot read."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from dflash_local.bench import machine


def test_cpu_flags_keep_the_vector_extensions_of_x86_and_arm(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("model name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 fma bmi2\n")
    assert machine.cpu_flags(x86) == ["avx", "avx2", "fma"]
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd evtstrm sve i8mm\n")
    assert machine.cpu_flags(arm) == ["asimd", "sve", "i8mm"]
    assert machine.cpu_flags(tmp_path / "missing") == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_the_blas_numpy_loaded_is_named_with_its_kernel():
    np.ones((4, 4)) @ np.ones((4, 4))  # numpy's BLAS is mapped into this process
    config = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
    found = machine.blas_libraries()
    assert found, "no BLAS library mapped"
    if "openblas" in config["name"]:  # OpenBLAS says which kernel it picked for this CPU
        assert any(entry["kernel"] for entry in found if "openblas" in entry["library"])


def test_a_missing_maps_file_names_no_library(tmp_path):
    assert machine.blas_libraries(tmp_path / "missing") == []
