"""Importing dflash_local changes nothing in the process: every module of the package, imported
in a fresh interpreter after the libraries it builds on, leaves the environment, the loaded
BLAS libraries, mlx-lm's attention names and Transformers' attention registry as they were.
Accelerations are installed by the engines, explicitly (dflash_local/accel/).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import importlib, json, os, pkgutil, sys

# what our modules import, so that their own import-time effects are not counted as ours; not
# MLX: our MLX modules must load no BLAS of ours when they bring it in (the engine installs it)
THIRD_PARTY = ["numpy", "torch", "transformers", "fastapi", "uvicorn", "httpx", "huggingface_hub",
               "platformdirs", "safetensors", "tokenizers"]
for name in THIRD_PARTY:
    try:
        importlib.import_module(name)
    except ImportError:
        pass


def attention_names():
    return {name: getattr(module, "scaled_dot_product_attention").__module__ + "." +
            getattr(module, "scaled_dot_product_attention").__qualname__
            for name, module in sorted(sys.modules.items())
            if name.startswith("mlx_lm.models.") and module is not None
            and hasattr(module, "scaled_dot_product_attention")}


def state():
    registries = {}
    if "transformers" in sys.modules:
        from transformers import AttentionInterface
        registries = {"attention_registry": sorted(AttentionInterface._global_mapping)}
    with open("/proc/self/maps") as maps:
        blas = sorted({line.split()[-1] for line in maps if "openblas" in line or "dflash_blas" in line})
    return {"environ": dict(os.environ), "blas": blas, "attention": attention_names(), **registries}


if sys.argv[1] == "reference":  # the libraries alone, MLX's included
    imported, skipped = [], {}
    for name in ("mlx.core", "mlx_lm"):
        try:
            importlib.import_module(name)
        except ImportError:
            pass
else:
    import dflash_local
    imported, skipped = [], {}
    for info in pkgutil.walk_packages(dflash_local.__path__, "dflash_local."):
        try:
            importlib.import_module(info.name)
            imported.append(info.name)
        except ImportError as exc:  # an optional engine's package that is not installed
            skipped[info.name] = str(exc)
print(json.dumps({"state": state(), "imported": imported, "skipped": skipped}))
"""


def _child(mode: str, tmp_path: Path) -> dict:
    env = {name: value for name, value in os.environ.items() if name != "OMP_WAIT_POLICY"}
    env["DFLASH_LOCAL_HOME"] = str(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", CHILD, mode], env=env, capture_output=True,
                            text=True, check=True, cwd=tmp_path)
    return json.loads(result.stdout.splitlines()[-1])


def test_importing_every_module_changes_nothing_in_the_process(tmp_path):
    """The process after importing all of dflash_local is the process after importing the
    libraries it builds on (mlx-lm sets an environment variable of its own, for one)."""
    report, reference = _child("package", tmp_path), _child("reference", tmp_path)
    for module, package in (("dflash_local.engines.mlx_engine", "mlx_lm"),
                            ("dflash_local.engines.torch_engine", "transformers")):
        assert module in report["imported"] or importlib.util.find_spec(package) is None, report["skipped"]
    ours, theirs = report["state"], reference["state"]
    assert ours["environ"] == theirs["environ"]
    assert ours["blas"] == theirs["blas"]
    assert ours.get("attention_registry") == theirs.get("attention_registry")
    assert all(value == "mlx_lm.models.base.scaled_dot_product_attention"
               for value in ours["attention"].values()), ours["attention"]
    assert ours["attention"] or importlib.util.find_spec("mlx_lm") is None  # the check ran
