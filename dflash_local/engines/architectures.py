"""Which target architectures each local engine runs, read from config.json alone (framework-free).

An engine checks a target before any weight loads; a refusal names the architecture, why this
engine cannot run it and which local engine can. The tables list what the architecture matrix
(tests/test_architecture_matrix.py) runs losslessly on each engine: the MLX engine runs exactly
the model types its adapters know (engines/mlx_adapters.py); the Transformers engine runs any
model whose layers it can roll back (engines/torch_rollback.py) and, of those with recurrent
layers, only the ones listed here, whose modeling hands the cache one state per row.
"""

from __future__ import annotations

from dflash_local.engines.table import LAUNCHED, MLX, TRANSFORMERS, engines_of_kind, find_engine
from dflash_local.errors import CheckpointError

MLX_MODEL_TYPES = frozenset({
    "llama", "mistral", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next",
    "gemma3", "gemma3_text", "gemma4", "gemma4_text", "gpt_oss",
})
# hybrid targets whose GatedDeltaNet layers compute per-row recurrent states when the cache
# asks (`recurrent_states_to_keep`): what a rollback restores
TORCH_RECURRENT_MODEL_TYPES = frozenset({"qwen3_5", "qwen3_5_moe", "qwen3_next"})


def runs_elsewhere(model_type: str, engine: str) -> str:
    """The end of a refusal: the local engine that runs this architecture, if one does."""
    if engine != MLX.name and model_type in MLX_MODEL_TYPES:
        return f"; the {MLX.label} engine runs it (--engine {MLX.name})"
    if engine != TRANSFORMERS.name and model_type in MLX_MODEL_TYPES | TORCH_RECURRENT_MODEL_TYPES:
        return f"; the {TRANSFORMERS.label} engine runs it (--engine {TRANSFORMERS.name})"
    servers = engines_of_kind(LAUNCHED)
    return (f"; {' or '.join(spec.label for spec in servers)} may serve it "
            f"({', '.join(f'--engine {spec.name}' for spec in servers)})")


def refuse(model_type: str, engine: str, why: str) -> CheckpointError:
    """The error an engine raises for a target it cannot run, before loading it."""
    spec = find_engine(engine)
    label = spec.label if spec is not None else engine
    return CheckpointError(f"target model_type {model_type!r} is not supported by the {label} "
                           f"engine ({why}){runs_elsewhere(model_type, engine)}")
