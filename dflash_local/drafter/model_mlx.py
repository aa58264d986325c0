"""The DFlash drafter in MLX (v1 and DFlash 2), with the checkpoint's own weight names.

Boundary: the model (layers, bounded context cache, loading z-lab checkpoints) and the
per-generation `DraftSession`. Numerically the same model as drafter/model_torch.py and z-lab's
MLX reference (the tests hold them equal); it has no embeddings or LM head of its own: `bind()`
borrows the target's. DFlash 2's convolutions and candidate selector are in dflash2_mlx.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from dflash_local.accel.mlx_attention import attend
from dflash_local.accel.mlx_rope import ROW_POSITIONED_ROPES, RowRope
from dflash_local.drafter import batch_mlx, dflash2_mlx, selector
from dflash_local.drafter.config import DrafterConfig, load_drafter_config
from dflash_local.errors import CheckpointError
from dflash_local.method.draft_tree import DraftTree, tree_from_logits


class Attention(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        hidden, head_dim, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(hidden, self.num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * head_dim, hidden, bias=bias)
        self.q_norm = nn.RMSNorm(head_dim, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(head_dim, eps=config.rms_norm_eps)

    @staticmethod
    def _heads(x: mx.array, count: int) -> mx.array:
        b, t, width = x.shape  # the head width spelled out: -1 cannot size zero rows
        return x.reshape(b, t, count, width // count).transpose(0, 2, 1, 3)  # [b, heads, t, d]

    def context_kv(self, ctx: mx.array, rope, offset: int) -> tuple[mx.array, mx.array]:
        """Keys/values of context rows (KV injection): they are only ever attended to."""
        keys = rope(self.k_norm(self._heads(self.k_proj(ctx), self.num_kv_heads)), offset=offset)
        return keys, self._heads(self.v_proj(ctx), self.num_kv_heads)

    def block_qkv(self, x: mx.array, rope, block_offset) -> tuple[mx.array, mx.array, mx.array]:
        """Queries, keys and values [b, heads, Q, d] of block rows x [b, Q, H] placed from
        `block_offset` (with a per-row RoPE: one position per row)."""
        queries = rope(self.q_norm(self._heads(self.q_proj(x), self.num_heads)), offset=block_offset)
        keys = rope(self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)), offset=block_offset)
        return queries, keys, self._heads(self.v_proj(x), self.num_kv_heads)

    def attend_block(self, queries, keys, values, ctx_keys, ctx_values, mask) -> mx.array:
        """One block's attention over its context and itself, [b, heads, Q, d]."""
        keys = mx.concatenate([ctx_keys, keys], axis=2)
        values = mx.concatenate([ctx_values, values], axis=2)
        return attend(queries, keys, values, self.scale, mask)

    def output(self, out: mx.array) -> mx.array:
        b, _, q_len, _ = out.shape
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, q_len, -1))

    def __call__(self, x, ctx_keys, ctx_values, rope, block_offset: int, mask):
        """x: [b, Q, H] block rows; ctx_keys/values: [b, kv, S, d]; mask: [Q, S+Q] bool or None."""
        queries, keys, values = self.block_qkv(x, rope, block_offset)
        return self.output(self.attend_block(queries, keys, values, ctx_keys, ctx_values, mask))


class MLP(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = MLP(config)
        self.convolved = config.dflash2 is not None
        if self.convolved:  # DFlash 2: each sublayer inside a convolution along the block
            conv = dflash2_mlx.GroupedDynamicCausalConv
            self.attention_conv = conv(config.hidden_size, config.dflash2)
            self.mlp_conv = conv(config.hidden_size, config.dflash2)

    def __call__(self, x: mx.array, attention) -> mx.array:
        """The block rows [b, W, H] after attention and the MLP; `attention` maps the normed
        rows to the attention's output (it holds the context's keys and values)."""
        attention_conv, mlp_conv = ((self.attention_conv, self.mlp_conv) if self.convolved
                                    else (dflash2_mlx.PASS_THROUGH,) * 2)
        rows, kernel = attention_conv.prepare(self.input_layernorm(x))
        x = x + attention_conv.finish(attention(rows), kernel)
        rows, kernel = mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + mlp_conv.finish(self.mlp(rows), kernel)


class ContextCache:
    """Per-layer keys/values of context rows; `end` = absolute position after the last row.

    `window` bounds what the block attends to (the draft sliding window); the buffers are
    compacted once they hold two windows, so memory stays flat on long contexts too.
    """

    def __init__(self, layers: int, window: int | None = None):
        self.window = window
        self.layers = [KVCache() for _ in range(layers)]
        self.end = 0

    def append(self, layer: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        cache = self.layers[layer]
        keys, values = cache.update_and_fetch(keys, values)
        if self.window is not None and keys.shape[2] > self.window:
            keys, values = keys[:, :, -self.window :], values[:, :, -self.window :]
            if cache.offset >= 2 * self.window:
                self.layers[layer] = KVCache()
                self.layers[layer].update_and_fetch(keys, values)
        return keys, values


@dataclass(frozen=True)
class Borrowed:
    """The target's parts the drafter uses; a plain object so MLX never treats them as ours."""

    embed_tokens: Any
    lm_head: Any


class DFlashDrafter(nn.Module):
    """Attribute names are z-lab's weight names: a checkpoint loads with no name map."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        taps_width = len(config.target_layer_ids) * config.hidden_size
        self.fc = nn.Linear(taps_width, config.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = [DecoderLayer(config) for _ in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.dflash2 is not None:
            self.candidate_selector = dflash2_mlx.CandidateSelector(
                config.hidden_size, config.vocab_size, config.dflash2)
        self._rope = initialize_rope(
            config.head_dim, base=config.rope_theta, traditional=False,
            scaling_config=config.rope_scaling,
            max_position_embeddings=config.max_position_embeddings,
        )
        self.borrowed: Borrowed | None = None  # the target's, never saved with us
        self.draft_head: DraftHead | None = None  # drafting over the draft vocabulary (draft_vocab.py)

    def bind(self, embed_tokens, lm_head) -> DFlashDrafter:
        """Borrow the target's embedding and head (tied targets: `embed_tokens.as_linear`)."""
        self.borrowed = Borrowed(embed_tokens, lm_head)
        return self

    def embed(self, token_ids: mx.array) -> mx.array:
        embeds = self.borrowed.embed_tokens(token_ids)
        if self.config.input_embedding_scale is not None:
            embeds = embeds * self.config.input_embedding_scale
        return embeds

    def logits(self, hidden: mx.array) -> mx.array:
        """Full-vocabulary logits (tests); drafting goes through `draft_token_ids`."""
        return self._shape_logits(self.borrowed.lm_head(hidden))

    def restrict_draft_vocab(self, token_ids: list[int]) -> None:
        """Draft from `token_ids` only: a head of just those rows of the target's head."""
        ids = mx.array(token_ids, dtype=mx.int32)
        projection, bias = _head_columns(self.borrowed.lm_head, ids, self.config.hidden_size,
                                         self.norm.weight.dtype)
        self.draft_head = DraftHead(projection, bias, ids)

    def draft_logits(self, hidden: mx.array) -> tuple[mx.array, mx.array | None]:
        """Logits over the draft vocabulary, and its token ids (None: the whole vocabulary)."""
        head = self.draft_head
        if head is None:
            return self.logits(hidden), None
        logits = hidden @ head.projection
        if head.bias is not None:
            logits = logits + head.bias
        return self._shape_logits(logits), head.token_ids

    def draft_token_ids(self, hidden: mx.array) -> mx.array:
        """Greedy proposals: argmax over the draft vocabulary."""
        logits, ids = self.draft_logits(hidden)
        best = mx.argmax(logits, axis=-1)
        return best if ids is None else mx.take(ids, best)

    def _shape_logits(self, logits: mx.array) -> mx.array:
        if self.config.output_multiplier is not None:
            logits = logits * self.config.output_multiplier
        if self.config.final_logit_softcapping is not None:
            cap = self.config.final_logit_softcapping
            logits = mx.tanh(logits / cap) * cap
        return logits

    def row_rope(self) -> RowRope | None:
        """The RoPE that places each row of a joined batch at its own position (batch_mlx.py);
        None where this RoPE cannot."""
        return RowRope(self._rope) if isinstance(self._rope, ROW_POSITIONED_ROPES) else None

    def new_cache(self, window: int | None = None) -> ContextCache:
        return ContextCache(len(self.layers), window)

    def draft(self, block_ids: mx.array, new_taps: mx.array, cache: ContextCache) -> mx.array:
        """block_ids: [b, W] (anchor + MASKs); new_taps: [b, n, taps*H] rows not yet cached.

        Returns the final-normed hidden states of the block, [b, W, H].
        """
        n_new, width = new_taps.shape[1], block_ids.shape[1]
        block_start = cache.end + n_new
        x = self.embed(block_ids).astype(self.fc.weight.dtype)
        ctx = self.hidden_norm(self.fc(new_taps))
        for index, layer in enumerate(self.layers):
            attn = layer.self_attn
            keys, values = cache.append(index, *attn.context_kv(ctx, self._rope, cache.end))
            mask = self.layer_mask(index, block_start - keys.shape[2], block_start, width)
            x = layer(x, partial(attn, ctx_keys=keys, ctx_values=values, rope=self._rope,
                                 block_offset=block_start, mask=mask))
        cache.end = block_start
        return self.norm(x)

    def layer_mask(self, index: int, ctx_start: int, block_start: int, width: int):
        """Same rule as model_torch._layer_mask: sliding layers see the last sliding_window
        positions, causal layers are causal inside the block; v1 layers need no mask."""
        sliding, causal = self.config.layer_is_sliding(index), self.config.layer_is_causal(index)
        if not sliding and not causal:
            return None
        key_pos = mx.arange(ctx_start, block_start + width)[None, :]
        block_pos = mx.arange(block_start, block_start + width)[:, None]
        allowed = mx.ones((width, key_pos.shape[1]), dtype=mx.bool_)
        if sliding:
            allowed = allowed & (key_pos > block_pos - self.config.sliding_window)
        if causal:
            allowed = allowed & (key_pos <= block_pos)
        return allowed


class DraftSession:
    """One generation's drafter (the `interfaces.Drafter` interface): owns the context cache."""

    tree_drafts = True

    def __init__(self, model: DFlashDrafter, window: int | None = None):
        self.model = model
        self.drafter_block = model.config.block_size
        self.cache = model.new_cache(window)

    @staticmethod
    def propose_batch(sessions: list[DraftSession], anchors: list[int], new_taps: list[mx.array],
                      widths: list[int]) -> list[list[int]]:
        """Each session's propose(anchor, taps, width) as one drafter pass: afterwards each
        session's context cache holds what its own propose leaves, and each proposal is its own.
        Sessions of one drafter; drafter/batch_mlx.py says which batch."""
        return batch_mlx.propose_batch(sessions, anchors, new_taps, widths)

    @staticmethod
    def propose_tree_batch(sessions: list[DraftSession], anchors: list[int],
                           new_taps: list[mx.array], nodes: list[int]) -> list[DraftTree]:
        """As `propose_batch`, each session's propose_tree(anchor, taps, nodes)."""
        return batch_mlx.propose_tree_batch(sessions, anchors, new_taps, nodes)

    def propose(self, anchor_id: int, new_taps: mx.array, width: int) -> list[int]:
        hidden = self._draft(anchor_id, new_taps, width)
        if self.model.config.dflash2 is not None:
            return selector.greedy_chain(self._selector_inputs(anchor_id, hidden))
        return self.model.draft_token_ids(hidden)[0].tolist()

    def propose_tree(self, anchor_id: int, new_taps: mx.array, nodes: int) -> DraftTree:
        hidden = self._draft(anchor_id, new_taps, nodes + 1)
        if self.model.config.dflash2 is not None:
            return selector.selector_tree(self._selector_inputs(anchor_id, hidden), nodes)
        logits, ids = self.model.draft_logits(hidden)
        logits = np.array(logits[0].astype(mx.float32))
        return tree_from_logits(logits, None if ids is None else np.array(ids), nodes)

    def _selector_inputs(self, anchor_id: int, hidden: mx.array) -> selector.SelectorInputs:
        """DFlash 2: the candidate selector's view of positions 1..width-1 (hidden [1, D, H])."""
        logits, ids = self.model.draft_logits(hidden)
        return self.model.candidate_selector.inputs(anchor_id, hidden[0], logits[0], ids)

    def _draft(self, anchor_id: int, new_taps: mx.array, width: int) -> mx.array:
        """Hidden states of block positions 1..width-1, [1, width-1, H]."""
        block = [anchor_id] + [self.model.config.mask_token_id] * (width - 1)
        new_taps = new_taps.astype(self.model.fc.weight.dtype)
        return self.model.draft(mx.array([block]), new_taps, self.cache)[:, 1:]


@dataclass(frozen=True)
class DraftHead:
    """Rows of the target's head for the draft vocabulary; a plain object, never saved."""

    projection: mx.array  # [H, K]: hidden @ projection = those ids' logits, less the bias
    bias: mx.array | None  # [K]
    token_ids: mx.array  # [K] int32, ascending


def _head_columns(head, ids: mx.array, hidden_size: int, dtype: mx.Dtype, chunk: int = 256):
    """Outputs `ids` of the target's head as (projection [H, K], bias [K] or None).

    An `nn.Linear` is sliced. Any other head (quantized, a tied embedding's `as_linear`) is
    applied to unit vectors: head(e_j) is row j of the projection plus the bias, exact without a
    bias (with one, `(w + b) - b` rounds once)."""
    if type(head) is nn.Linear:
        bias = head.bias[ids] if "bias" in head else None
        projection = head.weight[ids].T
        mx.eval(projection, *([bias] if bias is not None else []))
        return projection, bias
    bias = mx.take(head(mx.zeros((1, hidden_size), dtype=dtype))[0], ids)
    eye = mx.eye(hidden_size, dtype=dtype)
    rows = [mx.take(head(eye[start : start + chunk]), ids, axis=1) - bias
            for start in range(0, hidden_size, chunk)]
    projection = mx.concatenate(rows, axis=0)
    has_bias = bool(mx.any(bias != 0).item())
    mx.eval(projection, bias)
    return projection, (bias if has_bias else None)


def load_drafter(path: str | Path, dtype: mx.Dtype = mx.float32, in_memory: dict | None = None
                 ) -> DFlashDrafter:
    """Load a z-lab checkpoint directory as it is (v1 or DFlash 2): config.json + *.safetensors;
    `in_memory` (name -> numpy array) in place of the files' weights when they are in memory."""
    config = load_drafter_config(path)
    files = sorted(Path(path).glob("*.safetensors"))
    if in_memory is None and not files:
        raise CheckpointError(f"drafter directory {path} has no *.safetensors file")
    weights: dict[str, mx.array] = {}
    if in_memory is not None:
        weights = {name: mx.array(np.asarray(value)) for name, value in in_memory.items()}
        files = []
    for file in files:
        try:
            weights.update(mx.load(str(file)))
        except (RuntimeError, ValueError, OSError) as exc:
            raise CheckpointError(f"{file} is truncated or corrupt ({exc})") from None
    model = DFlashDrafter(config)
    _check_weights(model, weights, path)
    model.load_weights([(name, value.astype(dtype)) for name, value in weights.items()])
    mx.eval(model.parameters())
    return model


def _check_weights(model: DFlashDrafter, weights: dict[str, mx.array], path) -> None:
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: weights do not match the config "
            f"(missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''})"
        )
    for name, param in expected.items():
        if tuple(weights[name].shape) != tuple(param.shape):
            raise CheckpointError(
                f"{path}: weight {name} has shape {tuple(weights[name].shape)}, "
                f"config implies {tuple(param.shape)}"
            )
