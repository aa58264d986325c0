"""Every module of the package imports alone, as a fresh interpreter would import it first.

One child process loops over the modules; before each import it forgets every `dflash_local`
module (third-party libraries stay loaded, which keeps it fast), so an import cycle that only
the suite's import order hides fails here by name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import importlib, json, pkgutil, sys

import dflash_local

names = sorted(info.name for info in pkgutil.walk_packages(dflash_local.__path__, "dflash_local."))
failed, missing_extra = {}, {}
for name in names:
    for loaded in [m for m in sys.modules if m == "dflash_local" or m.startswith("dflash_local.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == "dflash_local":
            failed[name] = repr(exc)
        else:  # an optional engine's package that is not installed
            missing_extra[name] = exc.name
    except Exception as exc:
        failed[name] = repr(exc)
print(json.dumps({"names": names, "failed": failed, "missing_extra": missing_extra}))
"""


def _import_each(code: str = CHILD) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                            check=True, cwd=REPO)
    return json.loads(result.stdout.splitlines()[-1])


def test_every_module_imports_alone():
    report = _import_each()
    assert "dflash_local.method.speculative" in report["names"]  # the walk found the package
    assert report["failed"] == {}
    # only the optional engines' own packages may be missing here
    assert set(report["missing_extra"].values()) <= {"vllm", "sglang"}, report["missing_extra"]


def test_the_child_reports_a_cycle(tmp_path):
    """The check can fail: a package whose __init__ imports a module that imports the package
    back fails when the inner module is imported first."""
    package = tmp_path / "dflash_local"
    (package / "ring").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "ring" / "__init__.py").write_text("from dflash_local.ring.inner import VALUE\n")
    (package / "ring" / "inner.py").write_text("from dflash_local.outer import OTHER\nVALUE = 1\n")
    (package / "outer.py").write_text("from dflash_local.ring import VALUE\nOTHER = 2\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                            text=True, check=True, cwd=tmp_path)
    report = json.loads(result.stdout.splitlines()[-1])
    assert "dflash_local.outer" in report["failed"], report
