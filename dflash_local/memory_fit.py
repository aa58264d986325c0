"""Will it fit: a pair's weights plus its KV cache against this machine's memory.

Boundary: arithmetic on a target's config.json and a byte count; psutil only for the memory
available now. Nothing here downloads or loads.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}


def kv_cache_bytes(config: dict, context_tokens: int, dtype_bytes: int | None = None) -> int:
    """2 (K and V) * attention layers * kv_heads * head_dim * context * dtype bytes.

    Linear-attention (recurrent) layers hold no KV; sliding layers hold at most their window.
    """
    text = config.get("text_config") or config
    heads = int(text.get("num_attention_heads", 1))
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or text["hidden_size"] // heads)
    if dtype_bytes is None:
        dtype_bytes = DTYPE_BYTES.get(str(text.get("torch_dtype") or text.get("dtype")), 2)
    layer_types = text.get("layer_types") or ["full_attention"] * int(text["num_hidden_layers"])
    window = text.get("sliding_window") or context_tokens
    rows = 0
    for layer_type in layer_types:
        if layer_type == "linear_attention":
            continue
        rows += min(context_tokens, window) if layer_type == "sliding_attention" else context_tokens
    return 2 * kv_heads * head_dim * rows * dtype_bytes


@dataclass(frozen=True)
class FitEstimate:
    weights_bytes: int
    kv_bytes: int
    context_tokens: int
    available_bytes: int  # memory available now (psutil)

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.available_bytes

    def to_json(self) -> dict:
        return {**asdict(self), "total_bytes": self.total_bytes, "fits": self.fits}


def estimate_fit(weights_bytes: int, target_config: dict, context_tokens: int = 4096,
                 available_bytes: int | None = None) -> FitEstimate:
    if available_bytes is None:
        import psutil

        available_bytes = int(psutil.virtual_memory().available)
    return FitEstimate(weights_bytes=int(weights_bytes),
                       kv_bytes=kv_cache_bytes(target_config, context_tokens),
                       context_tokens=context_tokens, available_bytes=available_bytes)
