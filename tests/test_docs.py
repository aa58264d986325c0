"""The documents stay what a reader needs: the rendered benchmark pages match their records, the
README stays short and free of run history, and every relative link lands on a file."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
README_MAX_LINES = 200
# history belongs to git: clock-time ranges ("05:41-05:48") and run stamps ("20261205T055926")
HISTORY = re.compile(r"[0-9]{2}:[0-9]{2}-[0-9]{2}:[0-9]{2}|[0-9]{8}T[0-9]{6}")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def load_renderer():
    spec = importlib.util.spec_from_file_location("render_benchmarks",
                                                  ROOT / "scripts" / "render_benchmarks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rendered_benchmarks_match_the_records():
    stale = load_renderer().stale_files(ROOT)
    assert stale == [], f"run scripts/render_benchmarks.py: {', '.join(map(str, stale))} out of date"


def test_every_record_is_rendered_and_names_its_source():
    renderer = load_renderer()
    records = renderer.load_records(ROOT)
    assert records, "no benchmark records in docs/records/"
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    for name, record in records.items():
        assert f"records/{name}.json" in page
        assert record["source"]
        assert not HISTORY.search(str(record)), f"{name}: clock time or run stamp in the record"



def test_the_page_shows_the_current_tables_and_lists_the_other_records():
    renderer = load_renderer()
    records = renderer.load_records(ROOT)
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    headings = set(re.findall(r"^## (.+)$", page, re.MULTILINE))
    for name, record in records.items():
        if name in renderer.CURRENT:
            assert record["title"] in headings, name
            assert all(f"`{command}`" in page for command in renderer.commands(record)), name
        else:
            assert record["title"] not in headings, f"{name} is a development record: index it"
            assert f"(records/{name}.json): {record['compares']}\n" in page, name


def test_a_record_outside_the_current_tables_needs_what_it_compares():
    renderer = load_renderer()
    records = renderer.load_records(ROOT)
    name = next(name for name in sorted(records) if name not in renderer.CURRENT)
    del records[name]["compares"]
    with pytest.raises(ValueError, match=name):
        renderer.render_benchmarks(records)

def test_readme_is_short_and_has_no_run_history():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES
    assert HISTORY.search(text) is None, HISTORY.search(text)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_docs_have_no_run_history(path):
    match = HISTORY.search(path.read_text(encoding="utf-8"))
    assert match is None, f"{path.name}: {match.group(0)!r}"


@pytest.mark.parametrize("path", [README, ROOT / "models" / "README.md", *DOCS],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files(path):
    missing = []
    for target in LINK.findall(path.read_text(encoding="utf-8")):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the same page
        if not (path.parent / target.split("#")[0]).exists():
            missing.append(target)
    assert missing == [], f"{path.relative_to(ROOT)} links to missing files: {missing}"


def test_every_experiment_script_is_indexed():
    folder = ROOT / "scripts" / "experiments"
    index = (folder / "README.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^- `([^`]+)`: \S", index, re.MULTILINE))
    scripts = {path.name for path in folder.iterdir() if path.suffix in (".py", ".sh")}
    assert listed == scripts, f"unlisted: {sorted(scripts - listed)}; gone: {sorted(listed - scripts)}"
