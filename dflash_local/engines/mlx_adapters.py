"""Per-architecture adapters: run an mlx-lm target's decoder layers in an explicit loop.

Each adapter states, for one family of mlx-lm model classes, where the decoder stack lives,
how its input is scaled, which mask each layer gets and what the head is. The loop then
collects the drafter's taps (tap i = output of decoder layer i) without wrapping or swapping
any layer. Sliding-window layers get a plain KVCache (windowed by their mask) instead of
mlx-lm's RotatingKVCache, which cannot be trimmed once full. Hybrid targets (Qwen3.5/3.6,
Qwen3-Next) mark their GatedDeltaNet layers recurrent: their input is kept so the runner can
replay the accepted rows from the saved state (see MLXTargetRunner.commit). A tree verify runs
its rows as one sequence, each at the RoPE position of its depth (`rows_at_positions`), through
the RoPEs `install_row_rope` wrapped at load. An architecture without an adapter, or whose model
class the installed mlx-lm lacks, is refused from its config.json (`adapter_for`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import mlx.core as mx
import mlx_lm
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.utils import MODEL_REMAPPING

from dflash_local.accel import Installed, mlx_rope
from dflash_local.engines.architectures import refuse
from dflash_local.engines.table import MLX


@dataclass
class LayerRun:
    hidden: mx.array  # final-normed hidden states [1, T, H]
    taps: dict[int, mx.array] = field(default_factory=dict)  # layer index -> its output
    recurrent_inputs: dict[int, mx.array] = field(default_factory=dict)  # layer -> its input


class TargetAdapter:
    """The plain decoder stack `model.model` with `layer(h, mask, cache)` and one causal mask."""

    model_types: tuple[str, ...] = ()

    def full_attention(self, model) -> bool:
        """Whether `run` with one mask for every layer is exact: all layers full attention."""
        return True

    def install_row_rope(self, model) -> Installed:
        """At load, where a tree verify or a batched verify's lanes can run (`layer_windows`):
        RoPEs that also place rows one by one."""
        if self.layer_windows(model) is None:
            return Installed("mlx_rope")
        return mlx_rope.install(self.text_model(model).layers)

    def can_verify_trees(self, model) -> bool:
        """Whether one mask fits every layer and every layer's RoPE takes a row's own position
        (`install_row_rope` succeeded)."""
        return self.full_attention(model) and mlx_rope.installed(self.text_model(model).layers)

    def layer_windows(self, model) -> list[int | None] | None:
        """Each layer's sliding window (None: full attention) where every layer is attention over
        a plain KVCache masked causally within at most that window, so a batched verify can mask
        each layer's lanes itself (accel/mlx_lanes.py); None for a family with anything more
        (recurrent layers, attention sinks, a layer pattern not declared here)."""
        return [None] * len(self.text_model(model).layers) if self.full_attention(model) else None

    def rows_at_positions(self, cache: list, positions: mx.array) -> list:
        """The caches for a `run` whose rows sit at `positions` (one per row), not after the
        cache; the keys and values still go after it."""
        return mlx_rope.at_positions(cache, positions)

    def language_model(self, model):
        """The object holding `model` (the decoder stack) and `lm_head`."""
        return model

    def text_model(self, model):
        return self.language_model(model).model

    def lm_head(self, model):
        """The raw head (the drafter borrows it); tied targets use the embedding as linear."""
        language_model = self.language_model(model)
        if "lm_head" in language_model:  # an mlx Module is a dict of its children
            return language_model.lm_head
        return self.text_model(model).embed_tokens.as_linear

    def logits(self, model, hidden: mx.array) -> mx.array:
        return self.lm_head(model)(hidden)

    def make_cache(self, model) -> list:
        return [KVCache() if isinstance(c, RotatingKVCache) else c for c in make_prompt_cache(model)]

    def is_recurrent(self, layer) -> bool:
        return False

    def replay_recurrent(self, layer, layer_input: mx.array, cache) -> None:
        raise NotImplementedError

    def embed(self, inner, token_ids: mx.array) -> mx.array:
        return inner.embed_tokens(token_ids)

    def masks(self, inner, h: mx.array, cache: list) -> list:
        return [create_attention_mask(h, cache[0])] * len(inner.layers)

    def run(self, model, token_ids: mx.array, cache: list, tap_ids: frozenset[int],
            record_recurrent: bool = False, mask: mx.array | None = None) -> LayerRun:
        """`mask`: one mask for every layer (a tree verify) instead of the family's own."""
        inner = self.text_model(model)
        h = self.embed(inner, token_ids)
        run = LayerRun(hidden=h)
        masks = self.masks(inner, h, cache) if mask is None else [mask] * len(inner.layers)
        for index, (layer, layer_cache, layer_mask) in enumerate(
            zip(inner.layers, cache, masks, strict=True)
        ):
            if record_recurrent and self.is_recurrent(layer):
                run.recurrent_inputs[index] = h
            h = layer(h, layer_mask, layer_cache)
            if index in tap_ids:
                run.taps[index] = h
        run.hidden = inner.norm(h)
        return run


class Qwen3Adapter(TargetAdapter):
    model_types = ("qwen3", "qwen3_moe")


class LlamaAdapter(TargetAdapter):
    model_types = ("llama", "mistral")

    def full_attention(self, model) -> bool:
        return self.text_model(model).swa_idx is None

    def layer_windows(self, model):
        inner = self.text_model(model)
        return [inner.sliding_window if layer.use_sliding else None for layer in inner.layers]

    def masks(self, inner, h, cache):
        full = create_attention_mask(h, cache[inner.fa_idx])
        if inner.swa_idx is None:
            return [full] * len(inner.layers)
        sliding = create_attention_mask(h, cache[inner.swa_idx], window_size=inner.sliding_window)
        return [sliding if layer.use_sliding else full for layer in inner.layers]


class Qwen35Adapter(TargetAdapter):
    """Hybrid: GatedDeltaNet layers (ArraysCache, not trimmable) and full-attention layers."""

    model_types = ("qwen3_5", "qwen3_5_moe")

    def full_attention(self, model) -> bool:
        return False

    def language_model(self, model):
        return model.language_model

    def masks(self, inner, h, cache):
        full = create_attention_mask(h, cache[inner.fa_idx])
        ssm = create_ssm_mask(h, cache[inner.ssm_idx])
        return [ssm if layer.is_linear else full for layer in inner.layers]

    def is_recurrent(self, layer) -> bool:
        return layer.is_linear

    def replay_recurrent(self, layer, layer_input, cache) -> None:
        """Run the layer's own GatedDeltaNet on the accepted rows from the restored state.
        Only the cache update is evaluated later: MLX never computes the unused output."""
        layer.linear_attn(layer.input_layernorm(layer_input), None, cache)


class Qwen3NextAdapter(Qwen35Adapter):
    """Qwen3-Next: Qwen3.5's hybrid layers (GatedDeltaNet and gated attention, MoE MLPs) in a
    plain text model."""

    model_types = ("qwen3_next",)

    def language_model(self, model):
        return model


class GptOssAdapter(TargetAdapter):
    """gpt-oss: sliding-window and full-attention layers as its `layer_types` say."""

    model_types = ("gpt_oss",)

    def full_attention(self, model) -> bool:
        return False

    def masks(self, inner, h, cache):
        full = create_attention_mask(h, cache[inner.ga_idx])
        sliding = create_attention_mask(h, cache[inner.swa_idx], window_size=inner.window_size)
        return [full if kind == "full_attention" else sliding for kind in inner.layer_types]


class Gemma3Adapter(TargetAdapter):
    model_types = ("gemma3", "gemma3_text")

    def full_attention(self, model) -> bool:
        return False

    def language_model(self, model):
        return model.language_model if model.model_type == "gemma3" else model

    def embed(self, inner, token_ids):
        h = inner.embed_tokens(token_ids)
        return h * mx.array(inner.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)

    def masks(self, inner, h, cache):
        pattern = inner.sliding_window_pattern
        full = create_attention_mask(h, cache[pattern - 1])
        sliding = create_attention_mask(h, cache[0], window_size=inner.window_size)
        return [full if i % pattern == pattern - 1 else sliding for i in range(len(inner.layers))]


class Gemma4Adapter(TargetAdapter):
    """Per-layer input embeddings and KV sharing: the loop mirrors Gemma4TextModel.__call__."""

    model_types = ("gemma4", "gemma4_text")

    def full_attention(self, model) -> bool:
        return False

    def language_model(self, model):
        return model.language_model if model.model_type == "gemma4" else model

    def logits(self, model, hidden):
        logits = self.lm_head(model)(hidden)
        cap = self.language_model(model).final_logit_softcapping
        return logits if cap is None else mx.tanh(logits / cap) * cap

    def run(self, model, token_ids, cache, tap_ids, record_recurrent=False, mask=None):
        assert mask is None, "Gemma 4 runs its own per-layer masks: no tree verify"
        inner = self.text_model(model)
        embeds = inner.embed_tokens(token_ids)
        h = embeds * inner.embed_scale
        per_layer = [None] * len(inner.layers)
        if inner.hidden_size_per_layer_input:
            projected = inner._project_per_layer_inputs(
                h, inner._get_per_layer_inputs(token_ids, embeds)
            )
            per_layer = [projected[:, :, i, :] for i in range(len(inner.layers))]
        cache = cache + [None] * (len(inner.layers) - len(cache))  # KV-shared layers: no cache
        masks = inner._make_masks(h, cache)
        shared: list = [(None, None)] * len(inner.layers)
        run = LayerRun(hidden=h)
        for index, layer in enumerate(inner.layers):
            kvs, offset = shared[inner.previous_kvs[index]]
            h, kvs, offset = layer(h, masks[index], cache[index], per_layer_input=per_layer[index],
                                   shared_kv=kvs, offset=offset)
            shared[index] = (kvs, offset)
            if index in tap_ids:
                run.taps[index] = h
        run.hidden = inner.norm(h)
        return run


ADAPTERS: dict[str, TargetAdapter] = {
    model_type: adapter
    for adapter in (Qwen3Adapter(), LlamaAdapter(), Qwen35Adapter(), Qwen3NextAdapter(),
                    GptOssAdapter(), Gemma3Adapter(), Gemma4Adapter())
    for model_type in adapter.model_types
}


def adapter_for(model_type: str) -> TargetAdapter:
    """The adapter of an architecture this mlx-lm has a model class for; refused otherwise."""
    if model_type not in ADAPTERS:
        raise refuse(model_type, MLX.name, f"supported: {', '.join(sorted(ADAPTERS))}")
    module = f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}"
    try:
        importlib.import_module(module)
    except ImportError:
        raise refuse(model_type, MLX.name, f"mlx-lm {mlx_lm.__version__} has no {module}: "
                                        "a newer mlx-lm has it") from None
    return ADAPTERS[model_type]
