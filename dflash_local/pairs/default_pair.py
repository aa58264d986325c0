"""The pair a command loads: the names it was given, or the embedded pair when none.

Shared by `dflash-local generate` and `dflash-local bench` (and the scripts), so neither CLI
imports the other.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dflash_local import paths
from dflash_local.errors import ModelNotFoundError

EMBEDDED_DRAFTER_DIR = "smollm2-135m-dflash"  # under the repo's models/


def pair_names(
    target: str | None, drafter: str | None, speculative: bool
) -> tuple[str, str | None]:
    """The names to load: as given, or the embedded pair when no --target is given."""
    if target is not None:
        if drafter is None and speculative:
            _warn("no --drafter given: decoding without speculation")
        return target, drafter
    target = str(embedded_target())
    if drafter is not None:
        return target, drafter
    shipped = paths.shipped_models_dir() / EMBEDDED_DRAFTER_DIR
    if (shipped / "config.json").is_file():
        return target, str(shipped)
    if speculative:
        _warn(f"the embedded drafter is not in {shipped.parent} yet: decoding without speculation")
    return target, None


def embedded_target() -> Path:
    """The imported embedded target directory; a clear error when it is not imported yet."""
    from dflash_local.pairs import embedded

    path = embedded.embedded_target_dir()
    if not embedded.is_complete_import(path):
        raise ModelNotFoundError(
            f"no --target given and the embedded target is not imported yet ({path}): "
            f"run `dflash-local models import-embedded` once, or pass --target DIR|REPO"
        )
    return path


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)
