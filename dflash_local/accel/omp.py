"""OpenMP threads that sleep when idle, for torch on a CPU.

By default GNU OpenMP threads spin between parallel regions; on a 2-core machine shared with a
server, a UI or a second model, the spinning threads starve them and every step stalls. The
policy is read once, when torch loads its OpenMP runtime, so `install()` must come before the
first `import torch` (`engine_class_for("transformers")` calls it; the CLIs set it in `main`).
A policy the user set is kept.
"""

from __future__ import annotations

import os
import sys

from dflash_local.accel import Installed

VARIABLE = "OMP_WAIT_POLICY"


def install() -> Installed:
    """Set OMP_WAIT_POLICY=PASSIVE unless it is set or torch is loaded (too late to matter);
    `uninstall()` removes it again (the runtime has read it by then, if torch was loaded)."""
    if VARIABLE in os.environ or "torch" in sys.modules:
        return Installed("omp")
    os.environ[VARIABLE] = "PASSIVE"
    return Installed("omp", lambda: os.environ.pop(VARIABLE, None))
