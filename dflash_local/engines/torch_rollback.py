"""Rolling a Transformers target cache back to the rows a verify kept, for every layer kind.

Full-attention layers are cropped. Sliding-window layers and the recurrent layers of hybrid
targets (Qwen3.5/3.6's GatedDeltaNet: a conv state and a recurrent state) cannot be cropped
once they have moved on, so the cache records its past through each forward
(`activate_past_recording`, Transformers' own mechanism for assisted decoding): a sliding layer
keeps the keys and values the window would drop, and a GatedDeltaNet layer runs the verify's
rows one by one, keeping the recurrent state after each row and the conv inputs. `crop(-r)`
then restores the state before the r rejected rows; `crop(0)` after a forward that keeps every
row drops the record (bounded memory: a window, a conv kernel).

`checked_config` decides from the config alone, before any weight loads, whether every layer of
the target rolls back on the installed Transformers, and hands the config on to the model's load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import transformers
from transformers import AutoConfig, PreTrainedConfig
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    Cache,
    DynamicSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
    get_layer_types_and_kwargs,
)

from dflash_local.drafter.config import model_type_of
from dflash_local.engines.architectures import TORCH_RECURRENT_MODEL_TYPES, refuse
from dflash_local.engines.table import TRANSFORMERS

# layer kinds (Transformers' names) by how they roll back: cropped as they are; sliding windows
# and recurrent states, from the record of their past
CROPPED = ("full_attention", "dummy")
SLIDING = ("sliding_attention", "chunked_attention")
RECURRENT = ("linear_attention", "conv", "hybrid", "hybrid_sliding")


def recurrent_rollback_available() -> bool:
    """Whether this Transformers' linear-attention caches keep per-row states on request."""
    return (hasattr(LinearAttentionCacheLayerMixin, "activate_past_recording")
            and hasattr(Cache, "get_recurrent_states_to_keep"))


def sliding_rollback_available() -> bool:
    return hasattr(DynamicSlidingWindowLayer, "activate_past_recording")


def transformers_config(target_path: str | Path, model_type: str) -> PreTrainedConfig:
    """The target's config as Transformers builds it (defaults filled in): config only, no weights."""
    try:
        return AutoConfig.from_pretrained(target_path)
    except (ValueError, KeyError, OSError) as exc:
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise refuse(model_type, TRANSFORMERS.name,
                     f"transformers {transformers.__version__} cannot read its config: {first_line}")


def checked_config(target_path: str | Path, raw_config: dict[str, Any]) -> PreTrainedConfig:
    """The target's Transformers config; refused, naming the architecture, the layer kind and
    this Transformers' version, when a layer's cache cannot be rolled back after a partly
    rejected block. `raw_config`: its config.json as drafter/config.py `read_target_config` read it."""
    model_type = model_type_of(raw_config)
    config = transformers_config(target_path, model_type)
    layer_types = get_layer_types_and_kwargs(config.get_text_config(decoder=True))[0]
    _check_layer_kinds(model_type, list(layer_types))
    return config


def _check_layer_kinds(model_type: str, layer_types: list[str]) -> None:
    version = transformers.__version__
    for kind in dict.fromkeys(layer_types):
        if DYNAMIC_LAYER_TYPE_MAPPING.get(kind) is None:
            raise refuse(model_type, TRANSFORMERS.name,
                         f"transformers {version} has no cache for its {kind!r} layers")
        if kind in SLIDING and not sliding_rollback_available():
            raise refuse(model_type, TRANSFORMERS.name,
                         f"its {kind!r} layers cannot be rolled back: transformers {version} "
                         "has no past recording for sliding-window caches")
        if kind in RECURRENT and not recurrent_rollback_available():
            raise refuse(model_type, TRANSFORMERS.name,
                         f"its {kind!r} layers cannot be rolled back: transformers {version} "
                         "keeps no per-row recurrent states (no past recording)")
        if kind in RECURRENT and model_type not in TORCH_RECURRENT_MODEL_TYPES:
            raise refuse(model_type, TRANSFORMERS.name,
                         f"its {kind!r} layers are not known to hand their cache per-row "
                         f"states (known: {', '.join(sorted(TORCH_RECURRENT_MODEL_TYPES))})")
        if kind not in CROPPED + SLIDING + RECURRENT:
            raise refuse(model_type, TRANSFORMERS.name,
                         f"its {kind!r} layers have no rollback here "
                         f"(known: {', '.join(CROPPED + SLIDING + RECURRENT)})")


def before_forward(cache: Cache, rows: int) -> None:
    """Ready the cache for a forward of `rows` rows that may be rolled back to any of them:
    sliding layers keep what the window would drop; recurrent layers keep a state per row."""
    cache.activate_past_recording(recurrent_states_to_keep=rows)


def keep_rows(cache: Cache, rejected: int) -> None:
    """Drop the last forward's `rejected` rows from every layer, and whatever the record kept
    beyond what the next forward needs."""
    cache.crop(-rejected)
