"""Another drafter of the loaded pair in place of the serving one: an adapted version
(adapt/versions.py) or the shipped drafter again.

Boundary: the checks and the swap of a local engine's drafter; which version and when is
adapt/idle.py's. The new drafter is checked against the target (as the engine read it at load)
and against the serving drafter's shape before anything changes, so a refusal leaves the serving
one. Call it between generations only (the worker's idle slice): each generation takes its
drafter from the engine when it starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dflash_local.drafter.config import load_checked_drafter_config
from dflash_local.drafter.draft_vocab import load_draft_vocab
from dflash_local.errors import CheckpointError

if TYPE_CHECKING:
    from dflash_local.engines.local import LocalEngine


def swap_drafter(engine: LocalEngine, drafter_path: Path, version: int | None,
                 weights: dict | None = None) -> None:
    """`engine` drafts with the checkpoint at `drafter_path` from its next generation on;
    `version`: the adapted version it is (None: the shipped drafter); `weights`: the checkpoint's
    weights as numpy arrays when the caller holds them (a version just written), else read."""
    config = load_checked_drafter_config(drafter_path, engine.pair.target_path, engine.target_info)
    if engine.drafter is None or config != engine.drafter.config:
        raise CheckpointError(f"drafter {drafter_path}: its config is not the loaded drafter's "
                              f"(a version of another drafter): refused")
    vocab_size = engine.pair.draft_vocab_size
    draft_ids = load_draft_vocab(drafter_path, config.vocab_size) if vocab_size else None
    if vocab_size and len(draft_ids or ()) != vocab_size:
        raise CheckpointError(f"drafter {drafter_path}: its draft vocabulary is not the loaded "
                              f"drafter's ({vocab_size} tokens): refused")
    engine.drafter = engine.load_bound_drafter(drafter_path, config, engine.pair.dtype, draft_ids,
                                               weights)
    engine.drafter_version = version
