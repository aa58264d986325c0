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


def _script(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_service_scripts_records_name_the_machine_through_write_record(tmp_path, monkeypatch):
    """worker_stall and slow_clients: the machine described as every record's is, its load kept."""
    from argparse import Namespace

    pytest.importorskip("torch")
    monkeypatch.setattr(machine.machine_load, "load_average", lambda: 3.5)
    stall = Namespace(engine="transformers", stream_tokens=8, rest_s=0.1, repeats=1, alone_s=1.0,
                      record=tmp_path / "stall.json")
    gaps = [{"label": "alone", "bytes": 0, "status": "", "answer_s": None, "gap_s": 0.1},
            {"label": "deep", "bytes": 1024, "status": "400", "answer_s": 0.2, "gap_s": 0.3}]
    _script("worker_stall").record_results(stall, {"rows": gaps, "generations": 1, "load": 3.5})
    slow = Namespace(engine="transformers", idle=1, trickling=1, trickle_s=0.5, record=tmp_path / "slow.json")
    row = {"label": "sends nothing", "clients": 1, "closed": 1, "answered_408": 0, "first_s": 10.0,
           "median_s": 10.0, "last_s": 10.0}
    _script("slow_clients").record_results(slow, [row], [0.01])
    for path in (stall.record, slow.record):
        record = json.loads(path.read_text())
        details = record["machine_details"]
        assert record["machine"].startswith(details["cpu_model"]) and "load 3.5" in record["machine"]
        assert details["torch"]["cpu_capability"]  # the engine's kernel, though its server ran apart
