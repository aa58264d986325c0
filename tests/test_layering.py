"""The package's layers, read from the source with `ast` (nothing is imported):

- no import cycles among dflash_local modules, counting imports inside functions too and the
  package `__init__`s that importing a submodule runs;
- the method (`method/`) imports no framework, engine, service, pairs or command module;
- the core imports no ML framework, UI or web framework at module scope (the service may
  import FastAPI);
- the drafter never imports the engines;
- the TUI imports nothing of dflash_local but `paths` (it talks to the service over HTTP).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "dflash_local"
TUI = REPO / "tui" / "dflash_chat"
FRAMEWORKS = ("torch", "mlx", "mlx_lm", "transformers", "textual", "fastapi")
# the modules that must load without any framework: the loop, its rules, the CLIs' parsers,
# the service, the bench, the engine registry and interface, the accelerations' package
CORE_GLOBS = ("*.py", "drafter/config.py", "service/*.py", "bench/*.py", "method/**/*.py", "cli/*.py",
              "engines/__init__.py", "engines/interface.py", "engines/local.py",
              "engines/chat_prompt.py", "engines/options.py", "engines/selection.py", "engines/table.py",
              "adapt/record.py", "adapt/store.py", "adapt/versions.py", "adapt/idle.py",
              "engines/drafter_swap.py",
              "accel/__init__.py")
ALLOWED = {"service": {"fastapi"}}  # per core subpackage: what it may import at module scope


def module_name(path: Path) -> str:
    """`dflash_local/engines/local.py` -> `dflash_local.engines.local` (likewise under tui/)."""
    root = PACKAGE.parent if path.is_relative_to(PACKAGE) else TUI.parent
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_scope(body: list[ast.stmt]):
    """Statements that run at import: the body, into if/try blocks, not into defs or classes."""
    for node in body:
        yield node
        for block in ("body", "orelse", "finalbody"):
            if isinstance(node, ast.If | ast.Try) and hasattr(node, block):
                yield from _module_scope(getattr(node, block))
        for handler in getattr(node, "handlers", []) if isinstance(node, ast.Try) else []:
            yield from _module_scope(handler.body)


def imported_names(path: Path, module_scope: bool) -> set[str]:
    """Absolute names imported by the file: `a.b` and, for `from a.b import c`, `a.b.c` too."""
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = _module_scope(tree.body) if module_scope else ast.walk(tree)
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def runs_inits(name: str, importer: str, files: dict[str, Path]) -> set[str]:
    """Importing `a.b.c` runs `a/__init__` and `a/b/__init__` first: the packages above the
    imported module, less those above the importer (already being imported when it runs)."""
    parts = name.split(".")
    above_importer = {".".join(importer.split(".")[:i]) for i in range(1, importer.count(".") + 2)}
    return {".".join(parts[:i]) for i in range(1, len(parts))} & set(files) - above_importer


def package_files() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []
    for root, edges_of_root in graph.items():
        if root in index:
            continue
        work = [(root, iter(sorted(edges_of_root)))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = stack[stack.index(node):]
                del stack[stack.index(node):]
                if len(component) > 1:
                    found.append(sorted(component))
    return found


@pytest.mark.parametrize("module_scope", [True, False], ids=["module scope", "any scope"])
def test_no_import_cycles(module_scope):
    files = package_files()
    graph = {}
    for name, path in files.items():
        imported = {module for module in imported_names(path, module_scope) if module in files}
        graph[name] = (imported | {init for module in imported for init in runs_inits(module, name, files)}) - {name}
    assert cycles(graph) == []


def test_a_package_init_closes_a_cycle():
    """proposers -> planning.modes runs planning/__init__; were it to import planning.auto,
    which imports proposers, that is a cycle although no module names another directly."""
    files = dict.fromkeys(["p", "p.proposers", "p.planning", "p.planning.modes", "p.planning.auto"])
    assert runs_inits("p.planning.modes", "p.proposers", files) == {"p.planning"}
    assert runs_inits("p.planning.costs", "p.planning.auto", files) == set()


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def core_files() -> list[Path]:
    return sorted({path for pattern in CORE_GLOBS for path in PACKAGE.glob(pattern)})


@pytest.mark.parametrize("path", core_files(), ids=lambda path: str(path.relative_to(PACKAGE)))
def test_the_core_imports_no_framework_at_module_scope(path):
    relative = path.relative_to(PACKAGE)
    allowed = ALLOWED.get(relative.parts[0], set()) if len(relative.parts) > 1 else set()
    tops = {name.split(".")[0] for name in imported_names(path, module_scope=True)}
    assert tops & set(FRAMEWORKS) <= allowed


METHOD_MAY_NOT_IMPORT = ("dflash_local.engines", "dflash_local.service", "dflash_local.pairs",
                         "dflash_local.cli", "dflash_local.bench", "dflash_local.train", "dflash_local.drafter")


@pytest.mark.parametrize("path", sorted((PACKAGE / "method").rglob("*.py")),
                         ids=lambda path: str(path.relative_to(PACKAGE)))
def test_the_method_imports_only_the_method(path):
    """A reader opening method/ sees the algorithm: no framework at any scope, nothing of the
    engines, the service, the pairs or the commands."""
    names = imported_names(path, module_scope=False)
    assert {name.split(".")[0] for name in names} & set(FRAMEWORKS) == set()
    outside = {name for name in names if name.startswith(METHOD_MAY_NOT_IMPORT)}
    assert not outside, f"{path.relative_to(REPO)} imports {sorted(outside)}"


def test_the_drafter_imports_no_engine():
    for path in sorted((PACKAGE / "drafter").rglob("*.py")):
        engines = {name for name in imported_names(path, module_scope=False)
                   if name == "dflash_local.engines" or name.startswith("dflash_local.engines.")}
        assert not engines, f"{path.relative_to(REPO)} imports {sorted(engines)}"


def test_the_tui_imports_only_paths_from_dflash_local():
    used = set()
    for path in sorted(TUI.rglob("*.py")):
        used |= {name for name in imported_names(path, module_scope=False)
                 if name.split(".")[0] == "dflash_local"}
    assert used <= {"dflash_local", "dflash_local.paths", "dflash_local.paths.config_dir"}, used
