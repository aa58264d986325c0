"""The fit estimate of a catalog pair on each engine it names, or of the loaded pair, here.

Boundary: gather the numbers (a downloaded config.json, else the catalog's `arch`; the bytes on
disk or in a download's file listing, else the catalog's size or params x quantization), hold the weights as the engine will (a
CPU runs unquantized checkpoints in float32: precision.py), and hand them to memory_fit.py with
the engine's budget from memory_budget.py. Nothing here downloads or loads a model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dflash_local.pairs.catalog import ModelSpec, PairSpec
from dflash_local.pairs.memory_budget import EngineBudget
from dflash_local.pairs.memory_fit import (
    DTYPE_BYTES,
    QUANT_BYTES_PER_PARAM,
    FitEstimate,
    config_dtype_bytes,
    config_param_count,
    config_quantized,
    estimate_fit,
    weights_from_params,
)

UNKNOWN_DRAFTER_PARAMS_B = 1.0  # "a small draft model (~1B params)" (dflash-mlx README)
UNQUANTIZED = ("float32", "bf16", "float16")


@dataclass(frozen=True)
class ModelFiles:
    """What a fit reads of one model's files, read once: its config.json and its weights' bytes
    (None: not downloaded, or unreadable: the catalog's numbers serve)."""

    config: dict | None = None
    stored_bytes: int | None = None

    @classmethod
    def read(cls, local_dir: Path | None) -> ModelFiles:
        if local_dir is None:
            return NOT_LOCAL
        return cls(_read_config(local_dir), disk_bytes(local_dir))


NOT_LOCAL = ModelFiles()


def pair_fits(pair: PairSpec, budgets: dict[str, EngineBudget], context_tokens: int,
              target_files: ModelFiles = NOT_LOCAL, drafter_files: ModelFiles = NOT_LOCAL) -> dict[str, dict]:
    """Per engine the pair names: where it would run and, where it can run here, its estimate.
    The files' numbers where given (downloaded, or listed by a download), else the catalog's."""
    target_config, drafter_config = target_files.config, drafter_files.config
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
        target = held_bytes(pair.target, target_files.stored_bytes, target_config, run_bytes)
        drafter = held_bytes(pair.drafter, drafter_files.stored_bytes, drafter_config, run_bytes)
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
    target = ModelFiles.read(target_dir)
    if target.config is None:
        return {**budget.to_json(), "fit": None, "label": "served by another process: no estimate"}
    drafter = ModelFiles.read(drafter_dir) if drafter_dir is not None else None
    estimate = local_pair_fit(target, drafter, DTYPE_BYTES.get(dtype, 4), context_tokens,
                              budget.budget_bytes)
    return {**budget.to_json(), "fit": estimate.to_json(), "notes": [], "label": estimate.label()}


_BARE = ModelSpec(repo="local", source="hub")  # a directory: no catalog figures to fall back on


def local_pair_fit(target: ModelFiles, drafter: ModelFiles | None, run_bytes: int,
                   context_tokens: int, available_bytes: int | None) -> FitEstimate:
    """A pair in local directories (target config known), held in `run_bytes` per element. The
    target is never counted below what its config's shapes allocate, whatever its files hold:
    an engine builds the whole model before it reads a weight."""
    stored = held_bytes(_BARE, target.stored_bytes, target.config, run_bytes) or 0
    params = None if config_quantized(target.config) else config_param_count(target.config)
    weights = max(stored, (params or 0) * run_bytes)
    if drafter is not None:
        weights += held_bytes(_BARE, drafter.stored_bytes, drafter.config, run_bytes) or 0
    return estimate_fit(weights, target.config, context_tokens, available_bytes,
                        drafter_config=drafter.config if drafter else None, dtype_bytes=run_bytes)


def held_bytes(model: ModelSpec, stored: int | None, config: dict | None,
               run_bytes: int | None) -> int | None:
    """Bytes of the model's weights in memory: quantized weights as stored (`stored`: their
    bytes on disk, None: not downloaded); unquantized ones converted to `run_bytes` per element
    (None: kept in the checkpoint's type)."""
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


def _read_config(local_dir: Path) -> dict | None:
    try:
        return json.loads((local_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
