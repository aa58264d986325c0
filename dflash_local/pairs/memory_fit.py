"""Will it fit: what a pair needs in memory at a context length, against what an engine may use.

Needs = target weights + drafter weights + the target's KV cache at the context (attention layers
only; sliding-window layers hold at most their window) + the hybrid layers' fixed recurrent state
+ the drafter's context KV + a working allowance. The budget (what the engine may use) comes
from memory_budget.py. Boundary: arithmetic on config.json-shaped dicts and byte counts; nothing
here downloads, loads or probes the machine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}
# bytes per parameter of a checkpoint's quantization; MLX's affine 4/8-bit stores a bf16 scale and
# bias per group of 64 weights (+0.5 bit), MXFP4 an 8-bit scale per 32 (+0.25 bit)
QUANT_BYTES_PER_PARAM = {"float32": 4.0, "bf16": 2.0, "float16": 2.0, "8bit": 1.0625,
                         "6bit": 0.8125, "5bit": 0.6875, "4bit": 0.5625, "mxfp4": 0.53125}
RECURRENT_STATE_BYTES = 4  # GatedDeltaNet state is kept in float32 by the engines
DEFAULT_DRAFTER_LAYERS = 5  # the z-lab Qwen3 drafters' depth (DFLASH.md), when no config is at hand
WORKING_FLOOR_BYTES = 512 * 2**20  # runtime, allocator cache, a prefill step's activations
WORKING_WEIGHT_SHARE = 0.05  # temporaries that scale with the model (dequantized tiles, MoE routing)
MAX_CONTEXT_SEARCHED = 131072  # where a config names no limit of its own


def weights_from_params(params_b: float, quantization: str) -> int:
    """Bytes of weights of a `params_b`-billion model stored as `quantization`."""
    if quantization not in QUANT_BYTES_PER_PARAM:
        raise ValueError(f"quantization {quantization!r} is not one of {sorted(QUANT_BYTES_PER_PARAM)}")
    return int(params_b * 1e9 * QUANT_BYTES_PER_PARAM[quantization])


def config_param_count(config: dict) -> int | None:
    """A lower bound on a dense model's parameters from its config (attention, gated MLP, one
    embedding table): what an engine allocates whatever the weights files hold. None where the
    config lacks the sizes."""
    text = _text(config)
    try:
        hidden, layers = int(text["hidden_size"]), int(text["num_hidden_layers"])
        vocab, intermediate = int(text["vocab_size"]), int(text.get("intermediate_size") or 0)
        heads = int(text.get("num_attention_heads") or 1)
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or hidden // heads)
    except (KeyError, TypeError, ValueError):
        return None
    attention = hidden * head_dim * 2 * (heads + kv_heads)  # q, o and k, v projections
    return layers * (attention + 3 * hidden * intermediate) + vocab * hidden


def _text(config: dict) -> dict:
    return config.get("text_config") or config


def layer_types(config: dict) -> list[str]:
    """Each layer's kind: from `layer_types`, else the hybrid interval (every Nth layer is full
    attention, the rest linear), else Gemma 3's sliding pattern, else all full attention."""
    text = _text(config)
    count = int(text["num_hidden_layers"])
    if text.get("layer_types"):
        return list(text["layer_types"])
    if text.get("full_attention_interval"):
        every = int(text["full_attention_interval"])
        return ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(count)]
    if text.get("sliding_window_pattern") and text.get("sliding_window"):
        every = int(text["sliding_window_pattern"])
        return ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(count)]
    return ["full_attention"] * count


def prefix_row_bytes(config: dict, dtype_bytes: int, tap_count: int) -> int:
    """What one row of a kept prefix (prefix_cache.py) costs: the target's keys and values plus
    the drafter's taps of it."""
    return (kv_cache_bytes(config, 1, dtype_bytes)
            + tap_count * int(_text(config)["hidden_size"]) * dtype_bytes)


def config_quantized(config: dict) -> bool:
    """Whether the checkpoint stores quantized weights (mlx-lm's or Transformers' key)."""
    return bool(config.get("quantization") or config.get("quantization_config"))


def config_dtype_bytes(config: dict) -> int:
    text = _text(config)
    return DTYPE_BYTES.get(str(text.get("torch_dtype") or text.get("dtype")), 2)


def kv_cache_bytes(config: dict, context_tokens: int, dtype_bytes: int | None = None) -> int:
    """2 (K and V) * kv_heads * head_dim * rows * dtype bytes, summed over the attention layers.

    Linear-attention (recurrent) layers hold no KV; sliding layers hold at most their window;
    full layers of a Gemma 4 target use its global head size and KV heads.
    """
    text = _text(config)
    heads = int(text.get("num_attention_heads", 1))
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or text["hidden_size"] // heads)
    full_kv_heads = int(text.get("num_global_key_value_heads") or kv_heads)
    full_head_dim = int(text.get("global_head_dim") or head_dim)
    if dtype_bytes is None:
        dtype_bytes = config_dtype_bytes(config)
    window = text.get("sliding_window") or context_tokens
    per_token = 0  # K+V elements of all layers for one row
    for kind in layer_types(config):
        if kind == "linear_attention":
            continue
        if kind == "sliding_attention":
            per_token += kv_heads * head_dim * min(context_tokens, window) * 2
        else:
            per_token += full_kv_heads * full_head_dim * context_tokens * 2
    return per_token * dtype_bytes


def recurrent_state_bytes(config: dict, dtype_bytes: int | None = None) -> int:
    """The fixed state of the hybrid (GatedDeltaNet) layers, twice: the live state and the copy
    a round keeps to roll a partly rejected block back. Independent of the context length."""
    text = _text(config)
    linear_layers = layer_types(config).count("linear_attention")
    if not linear_layers:
        return 0
    key_heads, value_heads = int(text["linear_num_key_heads"]), int(text["linear_num_value_heads"])
    key_dim, value_dim = int(text["linear_key_head_dim"]), int(text["linear_value_head_dim"])
    conv_rows = int(text.get("linear_conv_kernel_dim", 4)) - 1
    conv_channels = 2 * key_heads * key_dim + value_heads * value_dim
    state = value_heads * key_dim * value_dim * RECURRENT_STATE_BYTES
    conv = conv_rows * conv_channels * (dtype_bytes or config_dtype_bytes(config))
    return 2 * linear_layers * (state + conv)


def drafter_kv_bytes(drafter_config: dict | None, target_config: dict, context_tokens: int,
                     draft_window: int | None = None, dtype_bytes: int | None = None) -> int:
    """The drafter's context KV (one row per committed token, at most `draft_window`). Without
    its config: DEFAULT_DRAFTER_LAYERS layers shaped like the target's attention layers."""
    rows = min(context_tokens, draft_window) if draft_window else context_tokens
    if drafter_config is not None:
        text = _text(drafter_config)
        plain = {key: text[key] for key in ("num_hidden_layers", "num_attention_heads",
                                            "num_key_value_heads", "head_dim", "hidden_size",
                                            "torch_dtype", "dtype") if key in text}
        return kv_cache_bytes(plain, rows, dtype_bytes)
    text = _text(target_config)
    shape = {key: text[key] for key in ("num_attention_heads", "num_key_value_heads", "head_dim",
                                        "hidden_size", "torch_dtype", "dtype") if key in text}
    return kv_cache_bytes({**shape, "num_hidden_layers": DEFAULT_DRAFTER_LAYERS}, rows, dtype_bytes)


@dataclass(frozen=True)
class FitEstimate:
    weights_bytes: int  # target + drafter weights
    kv_bytes: int  # the target's KV cache at context_tokens
    state_bytes: int  # hybrid layers' recurrent state (fixed)
    drafter_kv_bytes: int
    working_bytes: int
    context_tokens: int
    budget_bytes: int  # what the engine may use
    max_context: int | None  # the longest context that fits; None: none fits, or size only
    basis: str  # "config" | "catalog architecture" | "size only": where the KV figures came from
    context_limit: int | None = None  # the model's own longest context, where known

    @property
    def total_bytes(self) -> int:
        return (self.weights_bytes + self.kv_bytes + self.state_bytes + self.drafter_kv_bytes
                + self.working_bytes)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.budget_bytes

    def label(self) -> str:
        """What the picker shows: "fits up to N tokens of context" or "does not fit: ..."."""
        size_only = " (estimate from size only)" if self.basis == "size only" else ""
        if self.max_context and self.max_context == self.context_limit:
            return f"fits its whole context ({self.max_context:,} tokens)"
        if self.max_context:
            return f"fits up to {self.max_context:,} tokens of context"
        if self.fits:
            return f"fits: needs {gb(self.total_bytes)} GB, has {gb(self.budget_bytes)} GB{size_only}"
        return f"does not fit: needs {gb(self.total_bytes)} GB, has {gb(self.budget_bytes)} GB{size_only}"

    def to_json(self) -> dict:
        return {**asdict(self), "total_bytes": self.total_bytes, "fits": self.fits,
                "label": self.label()}


def gb(count: int) -> str:
    """Bytes as decimal gigabytes, one place: how every fit message writes a size."""
    return f"{count / 1e9:.1f}"


def working_bytes(weights_bytes: int) -> int:
    return WORKING_FLOOR_BYTES + int(WORKING_WEIGHT_SHARE * weights_bytes)


def estimate_fit(weights_bytes: int, target_config: dict | None, context_tokens: int = 4096,
                 available_bytes: int | None = None, *, drafter_config: dict | None = None,
                 draft_window: int | None = None, dtype_bytes: int | None = None,
                 basis: str = "config") -> FitEstimate:
    """`weights_bytes` counts target and drafter as held in memory; `available_bytes` is the
    engine's budget (default: the memory available now); `dtype_bytes` the KV cache's element
    size (default: the config's). Without a target config: from size only (no KV counted)."""
    if available_bytes is None:
        import psutil

        available_bytes = int(psutil.virtual_memory().available)

    def at(context: int) -> FitEstimate:
        if target_config is None:
            kv = state = draft_kv = 0
        else:
            kv = kv_cache_bytes(target_config, context, dtype_bytes)
            state = recurrent_state_bytes(target_config, dtype_bytes)
            draft_kv = drafter_kv_bytes(drafter_config, target_config, context, draft_window,
                                        dtype_bytes)
        return FitEstimate(int(weights_bytes), kv, state, draft_kv, working_bytes(weights_bytes),
                           context, int(available_bytes), None,
                           basis if target_config is not None else "size only")

    chosen = at(context_tokens)
    if target_config is None:
        return chosen
    declared = _text(target_config).get("max_position_embeddings")
    limit = int(declared or MAX_CONTEXT_SEARCHED)
    return FitEstimate(**{**asdict(chosen), "max_context": _longest_fitting(at, limit),
                          "context_limit": int(declared) if declared else None})


def _longest_fitting(at, limit: int) -> int | None:
    """The largest context in [1, limit] that fits (needs grow with the context), else None."""
    if not at(1).fits:
        return None
    low, high = 1, limit
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if at(middle).fits else (low, middle - 1)
    return low
