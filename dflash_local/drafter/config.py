"""Parse z-lab DFlash drafter checkpoints (config.json) into one frozen dataclass. Framework-free.

Both schema generations are accepted: `block_size` top-level (older) or in `dflash_config`
(newer); RoPE as `rope_theta` + `rope_scaling` (older) or `rope_parameters` (newer). Both
versions: v1 (`DFlashDraftModel`) and DFlash 2 (`DFlash2DraftModel`, whose `dflash_config` adds
the grouped dynamic convolutions' and the candidate selector's sizes: `DFlash2Config`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_local.errors import CheckpointError, IncompatiblePairError

ARCHITECTURES = {"DFlashDraftModel": "dflash", "DFlash2DraftModel": "dflash2"}
SUPPORTED_VERSIONS = ("dflash", "dflash2")
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclass(frozen=True)
class DFlash2Config:
    """What DFlash 2 adds to a layer and after the last one: each layer's attention and MLP
    wrapped in a grouped dynamic causal convolution over the block (`conv_kernel_size` taps,
    channels in groups of `conv_group_size` sharing a dynamic kernel), and a candidate selector
    that picks each position's draft among the `selector_top_k` best of the drafter's logits
    with a rank-`selector_rank` term between the token before it and the candidate."""

    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int


@dataclass(frozen=True)
class DrafterConfig:
    version: str  # "dflash" (v1) | "dflash2"
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = field(default=None, hash=False, compare=False)
    attention_bias: bool = False
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    is_causal: bool | None = None
    num_target_layers: int | None = None
    input_embedding_scale: float | None = None
    output_multiplier: float | None = None
    final_logit_softcapping: float | None = None
    dflash2: DFlash2Config | None = None  # None: a v1 drafter

    def layer_is_sliding(self, layer_index: int) -> bool:
        return (
            bool(self.layer_types)
            and self.layer_types[layer_index] == "sliding_attention"
            and self.sliding_window is not None
        )

    def layer_is_causal(self, layer_index: int) -> bool:
        """v1 layers are bidirectional in the block; sliding layers are causal unless overridden."""
        if self.is_causal is not None:
            return self.is_causal
        return bool(self.layer_types) and self.layer_types[layer_index] == "sliding_attention"


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab's rule: one draft layer taps the middle; else evenly from layer 1 to L-3."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    return tuple(
        round(start + i * (end - start) / (num_draft_layers - 1))
        for i in range(num_draft_layers)
    )


def load_drafter_config(path: str | Path) -> DrafterConfig:
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"drafter directory {path} has no config.json")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_path} is not valid JSON: {exc}") from None
    return parse_drafter_config(raw, source=str(config_path))


def parse_drafter_config(raw: dict[str, Any], source: str = "config.json") -> DrafterConfig:
    version = _version(raw, source)
    dflash = raw.get("dflash_config") or {}
    if "mask_token_id" not in dflash:
        raise CheckpointError(f"{source}: dflash_config.mask_token_id is missing")
    block_size = dflash.get("block_size", raw.get("block_size"))
    if block_size is None:
        raise CheckpointError(f"{source}: no block_size (neither top-level nor in dflash_config)")
    layers = _required(raw, "num_hidden_layers", source)
    target_layer_ids = dflash.get("target_layer_ids")
    if target_layer_ids is None:
        if raw.get("num_target_layers") is None:
            raise CheckpointError(
                f"{source}: dflash_config.target_layer_ids is missing and so is num_target_layers"
            )
        target_layer_ids = default_target_layer_ids(raw["num_target_layers"], layers)
    layer_types = tuple(raw.get("layer_types") or ())
    if all(kind == "full_attention" for kind in layer_types):
        layer_types = ()  # what save_pretrained writes for a drafter without sliding layers
    if layer_types and len(layer_types) != layers:
        raise CheckpointError(
            f"{source}: layer_types has {len(layer_types)} entries for {layers} layers"
        )
    rope_theta, rope_scaling = _rope(raw)
    heads = _required(raw, "num_attention_heads", source)
    hidden = _required(raw, "hidden_size", source)
    vocab = _required(raw, "vocab_size", source)
    dflash2 = _dflash2(dflash, hidden, vocab, source) if version == "dflash2" else None
    return DrafterConfig(
        version=version,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads", heads),
        head_dim=raw.get("head_dim") or hidden // heads,
        intermediate_size=_required(raw, "intermediate_size", source),
        vocab_size=vocab,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        max_position_embeddings=raw.get("max_position_embeddings", 40960),
        block_size=int(block_size),
        target_layer_ids=tuple(int(i) for i in target_layer_ids),
        mask_token_id=int(dflash["mask_token_id"]),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        attention_bias=bool(raw.get("attention_bias", False)),
        layer_types=layer_types,
        sliding_window=raw.get("sliding_window"),
        is_causal=raw.get("is_causal"),
        num_target_layers=raw.get("num_target_layers"),
        input_embedding_scale=dflash.get("input_embedding_scale"),
        output_multiplier=dflash.get("output_multiplier"),
        final_logit_softcapping=dflash.get("final_logit_softcapping"),
        dflash2=dflash2,
    )


def _dflash2(dflash: dict[str, Any], hidden: int, vocab: int, source: str) -> DFlash2Config:
    """The DFlash 2 fields of dflash_config, each a positive integer that fits the model."""
    values = {}
    for name in DFLASH2_FIELDS:
        value = dflash.get(name)
        if value is None:
            raise CheckpointError(f"{source}: DFlash 2 drafter without dflash_config.{name}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError(f"{source}: dflash_config.{name} must be an integer >= 1, got {value!r}")
        values[name] = value
    if hidden % values["conv_group_size"]:
        raise CheckpointError(
            f"{source}: dflash_config.conv_group_size {values['conv_group_size']} does not divide "
            f"hidden_size {hidden}")
    if values["selector_top_k"] > vocab:
        raise CheckpointError(
            f"{source}: dflash_config.selector_top_k {values['selector_top_k']} > vocab_size {vocab}")
    return DFlash2Config(**values)


def to_checkpoint_json(config: DrafterConfig) -> dict[str, Any]:
    """The config.json z-lab writes (newer schema: block_size inside dflash_config)."""
    dflash: dict[str, Any] = {
        "target_layer_ids": list(config.target_layer_ids),
        "mask_token_id": config.mask_token_id,
        "block_size": config.block_size,
    }
    for key in ("input_embedding_scale", "output_multiplier", "final_logit_softcapping"):
        if getattr(config, key) is not None:
            dflash[key] = getattr(config, key)
    if config.dflash2 is not None:
        dflash.update({name: getattr(config.dflash2, name) for name in DFLASH2_FIELDS})
    scaling = dict(config.rope_scaling or {})
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
    rope_parameters = {"rope_type": rope_type, **scaling, "rope_theta": config.rope_theta}
    raw: dict[str, Any] = {
        "architectures": ["DFlashDraftModel" if config.version == "dflash" else "DFlash2DraftModel"],
        "model_type": "qwen3",
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": config.attention_bias,
        "hidden_act": "silu",
        # Both RoPE spellings: older loaders read rope_theta/rope_scaling, Transformers 5 and the
        # newer z-lab checkpoints rope_parameters.
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "rope_parameters": rope_parameters,
        "num_target_layers": config.num_target_layers,
        "block_size": config.block_size,
        "dflash_config": dflash,
        # The rest of what Qwen3Config.save_pretrained writes (z-lab's checkpoints carry them, and
        # public loaders such as dflash-mlx read tie_word_embeddings): values of a drafter that
        # shares the target's embeddings and head and has no sliding layers unless it says so.
        "layer_types": list(config.layer_types) or ["full_attention"] * config.num_hidden_layers,
        "sliding_window": config.sliding_window,
        "use_sliding_window": config.sliding_window is not None,
        "max_window_layers": config.num_hidden_layers,
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "dtype": "bfloat16",
        "torch_dtype": "bfloat16",
    }
    if config.is_causal is not None:
        raw["is_causal"] = config.is_causal
    return raw


def _version(raw: dict[str, Any], source: str) -> str:
    architectures = raw.get("architectures") or []
    for name in architectures:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    raise CheckpointError(
        f"{source}: architectures {architectures} is not a DFlash drafter "
        f"(expected one of {sorted(ARCHITECTURES)})"
    )


def _required(raw: dict[str, Any], key: str, source: str):
    if key not in raw:
        raise CheckpointError(f"{source}: required key {key!r} is missing")
    return raw[key]


def _rope(raw: dict[str, Any]) -> tuple[float, dict | None]:
    params = raw.get("rope_parameters")
    if params:  # newer transformers: theta and scaling in one dict
        params = dict(params)
        theta = float(params.pop("rope_theta", raw.get("rope_theta", 1_000_000.0)))
        scaling = params if params.get("rope_type", "default") != "default" else None
        return theta, scaling
    scaling = raw.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(raw.get("rope_theta", 1_000_000.0)), scaling


@dataclass(frozen=True)
class TargetInfo:
    """What the compatibility check needs to know of a target, read from its config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    embedding_rows: int  # rows of embed_tokens (usually == vocab_size)
    max_position_embeddings: int = 0


def model_type_of(raw: dict[str, Any]) -> str:
    """The architecture as the checkpoint names it (the outer one of a multimodal wrapper)."""
    model_type = raw.get("model_type") or (raw.get("text_config") or {}).get("model_type")
    if not model_type:
        raise CheckpointError("the target's config.json names no model_type (nor does its text_config)")
    return str(model_type)


def target_info_from_config(raw: dict[str, Any]) -> TargetInfo:
    text = raw.get("text_config") or raw  # multimodal and hybrid configs nest the LM
    return TargetInfo(
        model_type=model_type_of(raw),
        vocab_size=int(text.get("vocab_size", raw.get("vocab_size", 0))),
        hidden_size=int(text["hidden_size"]),
        num_hidden_layers=int(text["num_hidden_layers"]),
        embedding_rows=int(text.get("vocab_size", raw.get("vocab_size", 0))),
        max_position_embeddings=int(text.get("max_position_embeddings", 0)),
    )


def read_target_config(path: str | Path) -> dict[str, Any]:
    """The target's config.json as a dict; a missing or broken file is a CheckpointError."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"target directory {path} has no config.json")
    try:
        return json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_path} is not valid JSON: {exc}") from None


def load_target_info(path: str | Path, raw: dict[str, Any] | None = None) -> TargetInfo:
    """`raw`: the config.json already read (read_target_config), else it is read here."""
    raw = read_target_config(path) if raw is None else raw
    try:
        return target_info_from_config(raw)
    except KeyError as exc:
        raise CheckpointError(f"{Path(path) / 'config.json'}: required key {exc.args[0]!r} is missing") from None


def check_compatible(
    drafter: DrafterConfig,
    target: TargetInfo,
    supported_versions: tuple[str, ...] = SUPPORTED_VERSIONS,
) -> list[str]:
    """Every reason this pair cannot work; an empty list means it can."""
    reasons = []
    if drafter.version not in supported_versions:
        reasons.append(
            f"drafter architecture {drafter.version!r} is not supported by this engine "
            f"(supported: {', '.join(supported_versions)})"
        )
    if drafter.vocab_size != target.vocab_size:
        reasons.append(f"drafter vocab_size {drafter.vocab_size} != target vocab_size {target.vocab_size}")
    if drafter.hidden_size != target.hidden_size:
        reasons.append(
            f"drafter hidden_size {drafter.hidden_size} != target hidden_size {target.hidden_size}"
        )
    for tap in drafter.target_layer_ids:
        if tap >= target.num_hidden_layers:
            reasons.append(f"drafter tap {tap} >= target layers {target.num_hidden_layers}")
        elif tap < 0:
            reasons.append(f"drafter tap {tap} is negative")
    if not 0 <= drafter.mask_token_id < target.embedding_rows:
        reasons.append(
            f"mask_token_id {drafter.mask_token_id} is outside the target's embedding table "
            f"of {target.embedding_rows} rows"
        )
    if drafter.num_target_layers is not None and drafter.num_target_layers != target.num_hidden_layers:
        reasons.append(
            f"drafter was trained for a target of {drafter.num_target_layers} layers, "
            f"this target has {target.num_hidden_layers}"
        )
    return reasons


def load_checked_drafter_config(drafter_path: str | Path, target_path: str | Path,
                                target: TargetInfo | None = None) -> DrafterConfig:
    """The drafter's config, or IncompatiblePairError with every reason it cannot run with
    this target. `target`: its info already read (load_target_info), else it is read here."""
    config = load_drafter_config(drafter_path)
    reasons = check_compatible(config, target or load_target_info(target_path))
    if reasons:
        raise IncompatiblePairError(reasons)
    return config
