"""A `dflash-local train --prompt-corpus` directory of the installed packages' subpackages.

`--prompt-corpus DIR` reads DIR/*.py and DIR/*/*.py: pointed at site-packages it sees each
package's top level only (the step-8 to step-11 data). This links every subpackage directory
(site-packages/PKG/SUB/...) that holds Python files into OUT as OUT/<hash>_<PKG_SUB_...>, so its
modules are one level down. The hash (of the name) orders the links: a regeneration cut short by
--regen-minutes has drawn from every package, not the first ones alphabetically. At most
--per-package subpackages per top-level package (transformers alone has ~600 near-identical model
folders), chosen by that hash; tests, private and data folders are skipped, and so is every
folder of a benchmark we report (MT-Bench's, HumanEval's) and of packages that are data or
generated types (tzdata, openai, google).

    .venv/bin/python scripts/make_subpackage_corpus.py runs/corpus13 [--per-package 30]
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import sysconfig
from pathlib import Path

SKIPPED_PACKAGES = ("tzdata", "openai", "google")
BENCHMARK_WORDS = ("mtbench", "human_eval")


def subpackage_dirs(site_packages: Path, per_package: int) -> list[tuple[str, Path]]:
    """(link name, directory), per_package at most per top-level package, benchmarks left out."""
    by_package: dict[str, list[tuple[str, str, Path]]] = collections.defaultdict(list)
    for folder in sorted(site_packages.glob("*/*/**/")):
        parts = folder.relative_to(site_packages).parts
        if len(parts) < 2 or parts[0] in SKIPPED_PACKAGES or not any(folder.glob("*.py")):
            continue
        if any("test" in p or p.startswith(("_", ".")) or p.endswith((".dist-info", ".libs")) for p in parts):
            continue
        name = "_".join(parts)
        by_package[parts[0]].append((hashlib.sha256(name.encode()).hexdigest()[:8], name, folder))
    chosen = [(f"{digest}_{name}", folder) for items in by_package.values()
              for digest, name, folder in sorted(items)[:per_package]]
    return [(link, folder) for link, folder in chosen if not any(w in link for w in BENCHMARK_WORDS)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--per-package", type=int, default=30)
    parser.add_argument("--site-packages", type=Path, default=Path(sysconfig.get_paths()["purelib"]))
    args = parser.parse_args()
    if not args.site_packages.is_dir():
        parser.error(f"--site-packages {args.site_packages} is not a directory")
    links = subpackage_dirs(args.site_packages.resolve(), args.per_package)
    if not links:
        parser.error(f"no subpackage folder with Python files under {args.site_packages}")
    args.out.mkdir(parents=True, exist_ok=True)
    for link, folder in links:
        path = args.out / link
        if not path.is_symlink():
            path.symlink_to(folder)
    print(f"{len(links)} subpackage folders linked under {args.out}")


if __name__ == "__main__":
    main()
