"""The DFlash drafter in PyTorch (v1 and DFlash 2: dflash2_torch.py), with the checkpoint's own
weight names.

Boundary: this file holds the model (layers, context cache, loading and saving z-lab
checkpoints). It has no embeddings or LM head of its own: `bind()` borrows the target's.
The same forward serves inference (context rows from a cache) and training (packed blocks
with an explicit block-sparse mask, see dflash_local/train/).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from dflash_local.drafter import batch_torch
from dflash_local.drafter.config import DrafterConfig, load_drafter_config, to_checkpoint_json
from dflash_local.drafter.dflash2_torch import CandidateSelector, GroupedCausalConv
from dflash_local.drafter.rope_torch import RotaryEmbedding, apply_rope
from dflash_local.drafter.selector import greedy_chain, selector_tree
from dflash_local.errors import CheckpointError
from dflash_local.method.draft_tree import DraftTree, tree_from_logits


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        hidden, head_dim, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, head_dim,
        )
        self.q_proj = nn.Linear(hidden, self.num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, count: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, count, self.head_dim).transpose(1, 2)  # [b, heads, t, d]

    def context_kv(self, ctx: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of context rows (KV injection): they are only ever attended to."""
        keys = apply_rope(self.k_norm(self._heads(self.k_proj(ctx), self.num_kv_heads)), *rope)
        return keys, self._heads(self.v_proj(ctx), self.num_kv_heads)

    def forward(self, x, ctx_keys, ctx_values, block_rope, mask):
        """x: [b, Q, H] block rows; ctx_keys/values: [b, kv, S, d]; mask: [Q, S+Q] bool or None."""
        b, q_len, _ = x.shape
        queries, keys, values = self.block_qkv(x, block_rope)
        out = self.attend(queries, torch.cat([ctx_keys, keys], dim=2),
                          torch.cat([ctx_values, values], dim=2), mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))

    def block_qkv(self, x, block_rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [b, heads, Q, d], keys and values [b, kv, Q, d] of the block rows."""
        queries = apply_rope(self.q_norm(self._heads(self.q_proj(x), self.num_heads)), *block_rope)
        keys = apply_rope(self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)), *block_rope)
        return queries, keys, self._heads(self.v_proj(x), self.num_kv_heads)

    def attend(self, queries, keys, values, mask) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads
        )


class MLP(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        sizes = config.dflash2  # DFlash 2: each sublayer between a convolution's two halves
        self.attention_conv = GroupedCausalConv(config.hidden_size, sizes) if sizes else None
        self.mlp_conv = GroupedCausalConv(config.hidden_size, sizes) if sizes else None


@dataclass
class ContextCache:
    """Per-layer keys/values of context rows; `start` = absolute position of the first kept row.

    `window` bounds it (the draft sliding window): draft cost stays flat on long contexts.
    """

    keys: list[torch.Tensor | None]
    values: list[torch.Tensor | None]
    start: int = 0
    end: int = 0  # absolute position after the last row
    window: int | None = None

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor):
        if self.keys[layer] is not None:
            keys = torch.cat([self.keys[layer], keys], dim=2)
            values = torch.cat([self.values[layer], values], dim=2)
        if self.window is not None and keys.shape[2] > self.window:
            keys, values = keys[:, :, -self.window :], values[:, :, -self.window :]
        self.keys[layer], self.values[layer] = keys, values
        return keys, values


class DFlashDrafter(nn.Module):
    """Attribute names are z-lab's weight names: a checkpoint loads with no name map."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)
        self.candidate_selector = (CandidateSelector(config.hidden_size, config.vocab_size, config.dflash2)
                                   if config.dflash2 else None)
        self._borrowed: tuple = ()  # (embed_tokens, lm_head): the target's, never saved with us
        self._draft_head: tuple = ()  # (head over the draft vocabulary, its token ids); see draft_vocab.py

    def bind(self, embed_tokens: nn.Module, lm_head) -> DFlashDrafter:
        self._borrowed = (embed_tokens, lm_head)
        return self

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        # the raw table, as z-lab does: a Gemma-style scaled embedding module would apply its
        # embed_scale on top of input_embedding_scale, which the drafter was not trained with
        embeds = F.embedding(token_ids, self._borrowed[0].weight)
        if self.config.input_embedding_scale is not None:
            embeds = embeds * self.config.input_embedding_scale
        return embeds

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits (training, tests); drafting goes through `draft_token_ids`."""
        return self._shape_logits(self._borrowed[1](hidden))

    def restrict_draft_vocab(self, token_ids: list[int], wrap=None) -> None:
        """Draft from `token_ids` only: a head of just those rows of the target's head.

        `wrap` may replace the new `nn.Linear` (the engine packs it for oneDNN). Like the
        borrowed parts, the head is not a submodule: build it after any `.to(device)`.
        """
        like = self.norm.weight
        ids = torch.tensor(token_ids, dtype=torch.long, device=like.device)
        weight, bias = _head_rows(self._borrowed[1], ids, self.config.hidden_size, like)
        head = nn.Linear(self.config.hidden_size, len(token_ids), bias=False, device="meta")
        head.weight = nn.Parameter(weight, requires_grad=False)
        head.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._draft_head = (wrap(head) if wrap else head, ids)

    def draft_logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits over the draft vocabulary, and its token ids (None: the whole vocabulary)."""
        if not self._draft_head:
            return self.logits(hidden), None
        head, ids = self._draft_head
        return self._shape_logits(head(hidden)), ids

    def draft_token_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy proposals: argmax over the draft vocabulary."""
        logits, ids = self.draft_logits(hidden)
        best = logits.argmax(-1)
        return best if ids is None else ids[best]

    def _shape_logits(self, logits: torch.Tensor) -> torch.Tensor:
        if self.config.output_multiplier is not None:
            logits = logits * self.config.output_multiplier
        if self.config.final_logit_softcapping:  # None or 0 = no soft-cap
            cap = self.config.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def new_cache(self, window: int | None = None) -> ContextCache:
        count = len(self.layers)
        return ContextCache([None] * count, [None] * count, window=window)

    def draft(self, block_ids: torch.Tensor, new_taps: torch.Tensor, cache: ContextCache) -> torch.Tensor:
        """block_ids: [b, W] (anchor + MASKs); new_taps: [b, n, taps*H] rows not yet cached.

        Returns the final-normed hidden states of the block, [b, W, H].
        """
        n_new, width = new_taps.shape[1], block_ids.shape[1]
        device = block_ids.device
        ctx_pos = torch.arange(cache.end, cache.end + n_new, device=device)
        block_pos = torch.arange(cache.end + n_new, cache.end + n_new + width, device=device)
        x = self.embed(block_ids)
        ctx = self.hidden_norm(self.fc(new_taps))
        ctx_rope, block_rope = self.rotary(ctx_pos, x.dtype), self.rotary(block_pos, x.dtype)
        for index, layer in enumerate(self.layers):
            new_keys, new_values = layer.self_attn.context_kv(ctx, ctx_rope)
            keys, values = cache.append(index, new_keys, new_values)
            kept_pos = torch.arange(cache.end + n_new - keys.shape[2], cache.end + n_new, device=device)
            mask = self._layer_mask(index, kept_pos, block_pos)
            x = self._layer(layer, x, keys, values, block_rope, mask)
        cache.end += n_new
        cache.start = cache.end - cache.keys[0].shape[2]
        return self.norm(x)

    def forward_packed(
        self, block_ids: torch.Tensor, taps: torch.Tensor, block_pos: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Training: blocks packed in one pass. taps: [b, S, taps*H] at positions 0..S-1;
        block_ids/block_pos: [b, Q]; mask: [b, 1, Q, S+Q] bool (True = may attend)."""
        x = self.embed(block_ids)
        ctx = self.hidden_norm(self.fc(taps))
        ctx_rope = self.rotary(torch.arange(taps.shape[1], device=taps.device), x.dtype)
        block_rope = self.rotary(block_pos, x.dtype)
        for layer in self.layers:
            keys, values = layer.self_attn.context_kv(ctx, ctx_rope)
            x = self._layer(layer, x, keys, values, block_rope, mask, self.config.block_size)
        return self.norm(x)

    @staticmethod
    def _layer(layer: DecoderLayer, x, keys, values, block_rope, mask, packed: int | None = None):
        """`packed`: x holds blocks of this many rows one after another (training)."""
        if layer.attention_conv is None:
            x = x + layer.self_attn(layer.input_layernorm(x), keys, values, block_rope, mask)
            return x + layer.mlp(layer.post_attention_layernorm(x))
        h, kernel = layer.attention_conv.prepare(layer.input_layernorm(x), packed)
        x = x + layer.attention_conv.finish(layer.self_attn(h, keys, values, block_rope, mask), kernel, packed)
        h, kernel = layer.mlp_conv.prepare(layer.post_attention_layernorm(x), packed)
        return x + layer.mlp_conv.finish(layer.mlp(h), kernel, packed)

    def _layer_mask(self, index: int, ctx_pos: torch.Tensor, block_pos: torch.Tensor):
        sliding, causal = self.config.layer_is_sliding(index), self.config.layer_is_causal(index)
        if not sliding and not causal:
            return None  # v1: the block sees all cached context and itself, both ways
        key_pos = torch.cat([ctx_pos, block_pos])
        allowed = torch.ones(len(block_pos), len(key_pos), dtype=torch.bool, device=block_pos.device)
        if sliding:
            window = self.config.sliding_window
            allowed &= key_pos[None, :] > block_pos[:, None] - window
            if not causal:  # a bidirectional sliding layer also bounds the look-ahead
                allowed &= key_pos[None, :] < block_pos[:, None] + window
        if causal:
            allowed &= key_pos[None, :] <= block_pos[:, None]
        return allowed


class DraftSession:
    """One generation's drafter (the `interfaces.Drafter` interface): owns the context cache."""

    tree_drafts = True

    def __init__(self, model: DFlashDrafter, window: int | None = None):
        self.model = model
        self.drafter_block = model.config.block_size
        self.cache = model.new_cache(window)
        # the norm's weight: the linears' may be released after oneDNN packing (accel/torch_linear)
        self._device, self._dtype = model.norm.weight.device, model.norm.weight.dtype

    @torch.inference_mode()
    def propose(self, anchor_id: int, new_taps: torch.Tensor, width: int) -> list[int]:
        hidden = self._draft(anchor_id, new_taps, width)
        if self.model.candidate_selector is not None:
            return greedy_chain(self._selector_inputs(anchor_id, hidden))
        return self.model.draft_token_ids(hidden)[0].tolist()

    @torch.inference_mode()
    def propose_tree(self, anchor_id: int, new_taps: torch.Tensor, nodes: int) -> DraftTree:
        hidden = self._draft(anchor_id, new_taps, nodes + 1)
        if self.model.candidate_selector is not None:
            return selector_tree(self._selector_inputs(anchor_id, hidden), nodes)
        logits, ids = self.model.draft_logits(hidden)
        return tree_from_logits(logits[0].float().cpu().numpy(),
                                None if ids is None else ids.cpu().numpy(), nodes)

    @staticmethod
    def propose_batch(sessions: list[DraftSession], anchors: list[int],
                      new_taps: list[torch.Tensor], widths: list[int]) -> list[list[int]]:
        """Each session's propose(anchor, taps, width) as one drafter pass: afterwards each
        session's context cache holds what its own propose leaves, and each proposal is its
        own (same argmax). Sessions of one drafter, v1 or DFlash 2 (drafter/batch_torch.py)."""
        return batch_torch.propose_batch(sessions, anchors, new_taps, widths)

    @staticmethod
    def propose_tree_batch(sessions: list[DraftSession], anchors: list[int],
                           new_taps: list[torch.Tensor], nodes: list[int]) -> list[DraftTree]:
        """As `propose_batch`, each session's propose_tree(anchor, taps, nodes)."""
        return batch_torch.propose_tree_batch(sessions, anchors, new_taps, nodes)

    def _selector_inputs(self, anchor_id: int, hidden: torch.Tensor):
        logits, ids = self.model.draft_logits(hidden)
        return self.model.candidate_selector.inputs(hidden[0], logits[0], ids, anchor_id)

    def _draft(self, anchor_id: int, new_taps: torch.Tensor, width: int) -> torch.Tensor:
        """Hidden states of block positions 1..width-1, [1, width-1, H]."""
        block = [anchor_id] + [self.model.config.mask_token_id] * (width - 1)
        block_ids = torch.tensor([block], device=self._device)
        return self.model.draft(block_ids, new_taps.to(self._dtype), self.cache)[:, 1:]


@torch.no_grad()
def _head_rows(head, ids: torch.Tensor, hidden_size: int, like: torch.Tensor, chunk: int = 256):
    """Rows `ids` of the target's head: (weight [K, H], bias [K] or None).

    An `nn.Linear` (tied heads included) is sliced. Any other head (oneDNN-packed: its weight is
    gone) is applied to unit vectors: head(e_j) is its column j plus the bias, exact without a
    bias (with one, `(w + b) - b` rounds once)."""
    if type(head) is nn.Linear:
        bias = None if head.bias is None else head.bias[ids].clone()
        return head.weight[ids].clone(), bias
    zeros = torch.zeros(1, hidden_size, dtype=like.dtype, device=like.device)
    bias = head(zeros)[0, ids]
    eye = torch.eye(hidden_size, dtype=like.dtype, device=like.device)
    columns = [head(eye[start : start + chunk])[:, ids] - bias for start in range(0, hidden_size, chunk)]
    return torch.cat(columns).T.contiguous(), (bias if bool(bias.any()) else None)


def load_drafter(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 weights: dict | None = None) -> DFlashDrafter:
    """Load a z-lab checkpoint directory as it is: config.json + *.safetensors; `weights` (name ->
    array, as the files hold them) in place of the files' when they are in memory already."""
    config = load_drafter_config(path)
    if weights is not None:
        model = DFlashDrafter(config)
        state = {name: torch.as_tensor(value) for name, value in weights.items()}
        _check_state(model, state, path)
        model.load_state_dict(state)
        return model.to(device=device, dtype=dtype).eval()
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"drafter directory {path} has no *.safetensors file")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state.update(load_file(str(file)))
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise CheckpointError(f"{file} is truncated or corrupt ({exc})") from None
    model = DFlashDrafter(config)
    _check_state(model, state, path)
    model.load_state_dict(state)
    return model.to(device=device, dtype=dtype).eval()


def _check_state(model: DFlashDrafter, state: dict[str, torch.Tensor], path) -> None:
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: weights do not match the config "
            f"(missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''})"
        )
    for name, tensor in expected.items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"{path}: weight {name} has shape {tuple(state[name].shape)}, "
                f"config implies {tuple(tensor.shape)}"
            )


def save_drafter(model: DFlashDrafter, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the exact z-lab format: config.json + model.safetensors (no name prefix)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().to(dtype).contiguous() for name, tensor in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(to_checkpoint_json(model.config), indent=2) + "\n")
    return out
