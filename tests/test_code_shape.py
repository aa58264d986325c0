"""The shape a reader can hold: the method on one screen, no capability probing in it, small files."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FILE_LINES = 400
MAX_LOOP_LINES = 60


def _function(path: Path, name: str) -> ast.FunctionDef:
    tree = ast.parse(path.read_text())
    return next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == name)


def test_the_loop_fits_on_one_screen():
    generate = _function(ROOT / "dflash_local" / "method" / "speculative.py", "generate")
    assert generate.end_lineno - generate.lineno + 1 <= MAX_LOOP_LINES


def test_the_method_declares_capabilities_instead_of_probing_them():
    paths = sorted((ROOT / "dflash_local" / "method").rglob("*.py"))
    assert paths
    for path in paths:  # the whole method: the loop, its proposers, planners and policies
        calls = {node.func.id for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
        assert not calls & {"hasattr", "getattr"}, path.name


def test_no_source_file_outgrows_a_reader():
    sources = [*(ROOT / "dflash_local").rglob("*.py"), *(ROOT / "tui").rglob("*.py")]
    assert sources
    too_long = {str(path.relative_to(ROOT)): lines for path in sources
                if (lines := len(path.read_text().splitlines())) > MAX_FILE_LINES}
    assert not too_long
