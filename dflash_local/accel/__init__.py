"""Accelerations an engine installs at load and uninstalls at close.

Each one changes something outside our code (a shared library in the process, a name in
mlx-lm's model modules, Transformers' attention registry, the modules of a loaded model), so it
is never done by importing a module: an engine calls `install(...)`, keeps the `Installed` it
gets, and calls `uninstall()` in `close()`. Importing anything under `dflash_local` leaves the
process as it was (tests/test_import_side_effects.py).

  blas.py            a fast OpenBLAS for MLX's CPU backend (before the first `import mlx.core`)
  mlx_attention.py   MLX attention on the CPU with a cheaper exponential (targets and drafter)
  mlx_rope.py        per-row RoPE positions for tree verification on MLX
  torch_attention.py grouped-query SDPA for CPU targets in Transformers
  torch_linear.py    oneDNN-packed linears for CPU float32 inference
  omp.py             OpenMP threads that sleep when idle (before torch is imported)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Installed:
    """One installed acceleration. Falsy when there was nothing to install (wrong device, no
    library); `uninstall()` undoes it once, later calls do nothing."""

    name: str
    _undo: Callable[[], None] | None = field(default=None, repr=False)

    def __bool__(self) -> bool:
        return self._undo is not None

    def uninstall(self) -> None:
        undo, self._undo = self._undo, None
        if undo is not None:
            undo()


def uninstall_all(installed: list[Installed]) -> None:
    """Undo in the reverse order of installation; empties the list."""
    while installed:
        installed.pop().uninstall()
