"""The fit estimate of a catalog pair on each engine it names, or of the loaded pair, here.

Boundary: gather the numbers (a downloaded config.json, else the catalog's `arch`; the bytes on
disk, else the catalog's size or params x quantization), hold the weights as the engine will (a
CPU runs unquantized checkpoints in float32: precision.py), and hand them to memory_fit.py with
the engine's budget from memory_budget.py. Nothing here downloads or loads a model.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_local.catalog import ModelSpec, PairSpec, locate
from dflash_local.errors import DFlashError
from dflash_local.memory_budget import EngineBudget
from dflash_local.memory_fit import (
    DTYPE_BYTES,
    QUANT_BYTES_PER_PARAM,
    config_dtype_bytes,
    config_quantized,
    estimate_fit,
    weights_from_params,
)

UNKNOWN_DRAFTER_PARAMS_B = 1.0  # "a small draft model (~1B params)" (dflash-mlx README)
UNQUANTIZED = ("float32", "bf16", "float16")


def pair_fits(pair: PairSpec, budgets: dict[str, EngineBudget], context_tokens: int,
              cache_dir: str | Path | None = None, look_local: bool = True) -> dict[str, dict]:
    """Per engine the pair names: where it would run and, where it can run here, its estimate.
    `look_local=False`: from the catalog's numbers only, as before any download."""
    target_dir, drafter_dir = ((_local_dir(pair.target, cache_dir), _local_dir(pair.drafter, cache_dir))
                               if look_local else (None, None))
    target_config, drafter_config = _read_config(target_dir), _read_config(drafter_dir)
    basis = "config" if target_config else "catalog architecture" if pair.architecture() else "size only"
    target_config = target_config or pair.architecture()
    fits = {}
    for engine in pair.engines:
        budget = budgets[engine]
        if not budget.runs_here or budget.budget_bytes is None:
            fits[engine] = {**budget.to_json(), "fit": None, "label": f"cannot run here: {budget.note}"}
            continue
        run_bytes = 4 if budget.device == "CPU" else None  # None: the checkpoint's own type
        notes: list[str] = []
        target = held_bytes(pair.target, target_dir, target_config, run_bytes)
        drafter = held_bytes(pair.drafter, drafter_dir, drafter_config, run_bytes)
        if drafter is None:
            drafter = weights_from_params(UNKNOWN_DRAFTER_PARAMS_B, "float32" if run_bytes else "bf16")
            notes.append(f"drafter size unknown: {UNKNOWN_DRAFTER_PARAMS_B:g}B parameters assumed")
        if target is None:
            fits[engine] = {**budget.to_json(), "fit": None, "notes": notes,
                            "label": "target size unknown: no estimate"}
            continue
        kv_bytes = run_bytes or _checkpoint_float_bytes(pair.target, target_config)
        estimate = estimate_fit(target + drafter, target_config, context_tokens, budget.budget_bytes,
                                drafter_config=drafter_config, dtype_bytes=kv_bytes, basis=basis)
        fits[engine] = {**budget.to_json(), "fit": estimate.to_json(), "notes": notes,
                        "label": estimate.label()}
    return fits


def loaded_fit(target_dir: Path | None, drafter_dir: Path | None, dtype: str,
               budget: EngineBudget, context_tokens: int) -> dict:
    """The loaded pair's own figure: its local directories, in the dtype it runs in."""
    target_config = _read_config(target_dir)
    if target_dir is None or target_config is None:
        return {**budget.to_json(), "fit": None, "label": "served by another process: no estimate"}
    run_bytes = DTYPE_BYTES.get(dtype, 4)
    bare = ModelSpec(repo=str(target_dir), source="hub")
    weights = held_bytes(bare, target_dir, target_config, run_bytes) or 0
    drafter_config = _read_config(drafter_dir)
    if drafter_dir is not None:
        weights += held_bytes(bare, drafter_dir, drafter_config, run_bytes) or 0
    estimate = estimate_fit(weights, target_config, context_tokens, budget.budget_bytes,
                            drafter_config=drafter_config, dtype_bytes=run_bytes)
    return {**budget.to_json(), "fit": estimate.to_json(), "notes": [], "label": estimate.label()}


def held_bytes(model: ModelSpec, local_dir: Path | None, config: dict | None,
               run_bytes: int | None) -> int | None:
    """Bytes of the model's weights in memory: quantized weights as stored; unquantized ones
    converted to `run_bytes` per element (None: kept in the checkpoint's type)."""
    stored = disk_bytes(local_dir) if local_dir is not None else None
    if stored is None and model.size_gb is not None:
        stored = int(model.size_gb * 1e9)
    if stored is None and model.params_b is not None and model.quantization is not None:
        stored = weights_from_params(model.params_b, model.quantization)
    if stored is None:
        return None
    quantized = model.quantization not in (None, *UNQUANTIZED) or config_quantized(config or {})
    if quantized or run_bytes is None:
        return stored
    if model.quantization in UNQUANTIZED:
        checkpoint = QUANT_BYTES_PER_PARAM[model.quantization]
    else:
        checkpoint = config_dtype_bytes(config or {})  # 2 (bf16) where the config says nothing
    return int(stored * run_bytes / checkpoint)


def _checkpoint_float_bytes(model: ModelSpec, config: dict | None) -> int:
    """The float type an accelerator runs the model in: the checkpoint's own (precision.py);
    quantized weights compute in their bf16 scales' type."""
    if model.quantization in UNQUANTIZED:
        return int(QUANT_BYTES_PER_PARAM[model.quantization])
    return config_dtype_bytes(config or {})  # 2 (bf16) where the config says nothing


def disk_bytes(local_dir: Path) -> int | None:
    files = list(local_dir.glob("*.safetensors"))
    return sum(path.stat().st_size for path in files) if files else None


def _local_dir(model: ModelSpec, cache_dir) -> Path | None:
    try:
        return locate(model, local_only=True, cache_dir=cache_dir)
    except DFlashError:  # not downloaded (or not imported yet): the catalog's numbers serve
        return None


def _read_config(local_dir: Path | None) -> dict | None:
    if local_dir is None:
        return None
    try:
        return json.loads((local_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
