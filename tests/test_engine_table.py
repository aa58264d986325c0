"""The engine table (dflash_local/engines/table.py) is the one place an engine is named.

- Read from the source with `ast`: an engine's name is a string literal in the table module
  only (a few modules name a *package* that shares an engine's name: listed, with why).
- A fake engine added as one row appears wherever lists of engines derive (the CLIs' choices,
  the catalog, the budgets `/dflash/catalog` reports, the service's engine check, `serve`'s
  per-engine options) and loads through `engine_class_for` / `load_engine` from the row alone.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from dflash_local.engines import engine_class_for, load_engine, table
from dflash_local.engines.table import KINDS, LOCAL, OPENAI, EngineSpec
from dflash_local.errors import EngineUnavailableError

PACKAGE = Path(__file__).resolve().parent.parent / "dflash_local"
TABLE = PACKAGE / "engines" / "table.py"
# import or distribution names that happen to equal an engine's name: the package, not the engine
PACKAGE_NAMES = {
    "accel/blas.py": {"mlx"},  # finds the mlx package to bind its BLAS
    "bench/peer_driver.py": {"mlx"},  # the Mac peers' packages
    "method/calibration.py": {"mlx", "transformers"},  # distributions whose versions key a cache
    "pairs/embedded.py": {"transformers"},  # the packages the GGUF import needs
}


def engine_literals(source: str, names: set[str]) -> set[str]:
    """The string constants of `source` that are engine names (f-string parts included)."""
    return {node.value for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and node.value in names}


def test_an_engine_is_named_only_in_the_table():
    names = set(table.engine_names())
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        literals = engine_literals(path.read_text(), names)
        if literals and path != TABLE:
            found[path.relative_to(PACKAGE).as_posix()] = literals
    assert found == PACKAGE_NAMES  # equal: a listed exception that is gone is dropped here too


def test_the_scan_sees_a_name_in_a_condition_and_a_dict():
    source = 'if engine in ("vllm", "other"):\n    hints = {"mlx": 1}\nlabel = f"{x}"\n'
    assert engine_literals(source, set(table.engine_names())) == {"vllm", "mlx"}


def test_every_row_is_complete():
    names = table.engine_names()
    assert len(set(names)) == len(names)
    for spec in table.ENGINES:
        assert spec.kind in KINDS, spec
        # find_spec imports the parent package only: no framework loads
        assert importlib.util.find_spec(spec.module) is not None, spec.module
        if spec.before_import is not None:
            assert importlib.util.find_spec(spec.before_import.partition(":")[0]) is not None
    for order in table.AUTO_ORDER.values():
        assert set(order) <= set(table.ENGINES)


def test_the_relay_is_a_row_like_the_others():
    assert engine_class_for(OPENAI.name).__name__ == "RemoteEngine"


# --- a fake engine, added as one row ---

class FakeEngine:
    """Stands for an Engine subclass: records how the loader built it."""

    def __init__(self, target, drafter, **opts):
        self.target, self.drafter, self.opts = target, drafter, opts


HOOK_CALLS = []


def before_fake_import() -> None:
    HOOK_CALLS.append("installed")


FAKE = EngineSpec("fake", LOCAL, "Fake", __name__, "FakeEngine", "pip install fake-engine",
                  detect="fake_engine_not_installed",
                  before_import=f"{__name__}:before_fake_import")


@pytest.fixture
def fake_row(monkeypatch):
    monkeypatch.setattr(table, "ENGINES", (*table.ENGINES, FAKE))
    return FAKE


def parse(*argv: str):
    from dflash_local.cli.main import build_parser

    return build_parser().parse_args(list(argv))


def test_without_the_row_the_clis_refuse_the_engine():
    with pytest.raises(SystemExit):
        parse("generate", "hi", "--engine", "fake")


def test_the_fake_row_is_an_engine_choice_of_every_command(fake_row):
    assert parse("generate", "hi", "--engine", "fake").engine == "fake"
    assert parse("serve", "--engine", "fake").engine == "fake"
    assert parse("bench", "--engine", "fake").engine == "fake"


def test_serve_gives_the_fake_local_engine_the_local_options(fake_row):
    from dflash_local.service.cli_serve import _load_options

    options = _load_options(parse("serve", "--engine", "fake", "--no-prefix-cache"))
    assert options["fake"] == {"dtype": "auto", "prefix_cache": False, "prefix_cache_mb": None}


def test_the_catalog_and_the_service_know_the_fake_row(fake_row, tmp_path):
    from dflash_local.pairs.catalog import catalog_path, load_catalog
    from dflash_local.service.state import pick_engine

    text = catalog_path().read_text().replace('engines = ["transformers", "mlx"]',
                                             'engines = ["transformers", "mlx", "fake"]', 1)
    (tmp_path / "catalog.toml").write_text(text)
    embedded = load_catalog(tmp_path / "catalog.toml").get("embedded")
    assert "fake" in embedded.engines
    assert pick_engine("fake") == "fake"


def test_the_budgets_list_the_fake_row_with_its_install_hint(fake_row):
    from dflash_local.pairs.memory_budget import engine_budgets

    budget = engine_budgets()["fake"]
    assert not budget.runs_here and budget.note == "not installed (pip install fake-engine)"


def test_engine_class_for_loads_the_fake_class_from_the_row(fake_row):
    HOOK_CALLS.clear()
    assert engine_class_for("fake") is FakeEngine
    assert HOOK_CALLS == ["installed"]  # the row's before-import hook ran first


def test_load_engine_builds_the_fake_local_engine(fake_row, tmp_path):
    engine = load_engine("fake", str(tmp_path), None, dtype="float32")
    assert (engine.target, engine.drafter) == (tmp_path.resolve(), None)
    assert engine.opts == {"target_name": str(tmp_path), "drafter_name": None, "dtype": "float32"}


def test_a_missing_required_package_names_the_rows_install_hint(monkeypatch):
    needs = EngineSpec("needy", LOCAL, "Needy", __name__, "FakeEngine", "pip install needy-extra",
                       requires=("needy_package_not_installed",))
    monkeypatch.setattr(table, "ENGINES", (*table.ENGINES, needs))
    with pytest.raises(EngineUnavailableError,
                       match="needy_package_not_installed.*pip install needy-extra"):
        engine_class_for("needy")
