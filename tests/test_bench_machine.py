"""What a benchmark record says of the machine (bench/machine.py): the vector extensions, the
BLAS libraries in the process with the kernel OpenBLAS chose, and nothing it cannot read."""

from __future__ import annotations

import json
import subprocess
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


def test_a_scripts_record_names_its_machine_in_words_and_in_full(tmp_path, monkeypatch):
    """report.write_record: the line the benchmarks page prints and the whole description."""
    from dflash_local.bench import report

    monkeypatch.setattr(machine, "cpu_flags", lambda: ["avx", "avx2"])
    monkeypatch.setattr(report, "describe", lambda threads=None: {
        **machine.describe(threads), "cpu_model": "AMD EPYC 7B13", "cores": 2,
        "cpu_flags": machine.cpu_flags(), "load_average": 6.5})
    path = tmp_path / "record.json"
    written = report.write_record(path, {"title": "a figure"}, threads=2, setting="a virtual machine")
    assert json.loads(path.read_text()) == written
    assert written["title"] == "a figure"
    assert written["machine"].startswith("AMD EPYC 7B13 (2 cores, avx2")
    assert written["machine"].endswith("; a virtual machine; load 6.5)")
    details = written["machine_details"]
    assert details["threads"]["engine"] == 2 and details["cpu_flags"] == ["avx", "avx2"]


def test_a_script_whose_engine_runs_in_a_child_names_that_engines_kernel():
    """describe_engine imports the framework first: a service's script has not loaded it itself."""
    pytest.importorskip("torch")
    code = ("import json; from dflash_local.bench.machine import describe, describe_engine; "
            "print(json.dumps([describe()['torch'], describe_engine('transformers')['torch']]))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, after = json.loads(result.stdout)
    assert before is None
    assert after["cpu_capability"]
