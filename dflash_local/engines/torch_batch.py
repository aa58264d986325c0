"""Several generations' verifies as one Transformers forward: ragged rows, not a padded batch.

Every runner's verify rows are concatenated into one sequence [1, sum N_i], so each linear
(attention projections, MLP, LM head) reads its weights once for all of them; each row carries
its own position (the runner's context length plus its depth in the tree). Attention is the one
step that stays per runner: `RaggedCache` appends each runner's new keys and values to that
runner's own cache, and `ragged_attention` attends each runner's query rows to its own keys under
its own chain or tree mask. No key or value is copied into a shared batch.

Only targets whose layers are all full attention and whose modeling hands the cache's keys
straight to the attention function batch (`RAGGED_MODEL_TYPES`); any other falls back to one
verify per runner. The engine's runner state (pending taps, rows to roll back) is set here as its
own verify sets it, so `commit` works unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

from dflash_local.engines import torch_rollback
from dflash_local.method.draft_tree import DraftTree

RAGGED = "dflash_ragged_verify"  # registered only while a batched forward runs
# modeling files (Transformers' names) whose attention passes `cache.update`'s result to the
# attention function untouched: the lists `RaggedCache.update` returns reach `ragged_attention`
RAGGED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen3_moe"})


@dataclass(frozen=True)
class RaggedRows:
    """Where each runner's rows sit in the batch, and what they may attend to."""

    spans: tuple[tuple[int, int], ...]  # runner i's rows are [start, stop) of the batch
    masks: tuple[torch.Tensor | None, ...]  # [1, 1, rows, past + rows]; None: sees all
    attend: Callable  # the model's own attention function, run once per runner


class RaggedCache:
    """Handed to the model as its cache: splits each layer's new keys and values by runner into
    that runner's own cache, and returns every runner's whole keys and values as lists."""

    def __init__(self, caches: Sequence, spans: tuple[tuple[int, int], ...]):
        self.caches, self.spans = caches, spans

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = [], []
        for cache, (start, stop) in zip(self.caches, self.spans):
            whole_key, whole_value = cache.update(key[:, :, start:stop], value[:, :, start:stop],
                                                  layer_idx)
            keys.append(whole_key)
            values.append(whole_value)
        return keys, values


def ragged_attention(module: torch.nn.Module, query: torch.Tensor, keys: list[torch.Tensor],
                     values: list[torch.Tensor], attention_mask, dropout: float = 0.0,
                     scaling: float | None = None, ragged_rows: RaggedRows | None = None, **kwargs):
    """Transformers' attention-function signature; query [1, heads, sum N, dim], one key and
    value tensor per runner, each attended through the model's own attention function under that
    runner's mask. Returns ([1, sum N, heads, dim], no weights)."""
    assert ragged_rows is not None, "ragged attention runs only inside verify_batch"
    outputs = [
        ragged_rows.attend(module, query[:, :, start:stop], key, value, mask, dropout=dropout,
                           scaling=scaling, **kwargs)[0]
        for (start, stop), key, value, mask in zip(ragged_rows.spans, keys, values,
                                                   ragged_rows.masks)
    ]
    return torch.cat(outputs, dim=1), None


def can_batch(runner) -> bool:
    """Whether this runner's target verifies as part of a ragged forward: declared per
    architecture, every layer full attention (`supports_tree`), text only."""
    config = runner.model.config
    return (getattr(config, "model_type", None) in RAGGED_MODEL_TYPES and runner.supports_tree
            and not getattr(config, "sub_configs", None))


def verify_batch(runners: Sequence, anchors: Sequence[int],
                 trees: Sequence[DraftTree]) -> list[np.ndarray]:
    """Each runner's `verify(anchor, tree)` as one forward; see TorchTargetRunner.verify_batch."""
    if not len(runners) == len(anchors) == len(trees):
        raise ValueError(f"verify_batch: {len(runners)} runners, {len(anchors)} anchors, "
                         f"{len(trees)} trees")
    model = runners[0].model if runners else None
    if any(runner.model is not model for runner in runners):
        raise ValueError("verify_batch: the runners belong to different models")
    if len(runners) < 2 or not can_batch(runners[0]):
        return [runner.verify(anchor, tree) for runner, anchor, tree in zip(runners, anchors, trees)]
    return _ragged_verify(model, runners, anchors, trees)


@torch.inference_mode()
def _ragged_verify(model, runners, anchors, trees) -> list[np.ndarray]:
    device = model.device
    stops = np.cumsum([len(tree.token_ids) + 1 for tree in trees]).tolist()
    spans = tuple(zip([0, *stops[:-1]], stops))
    ids = [token for anchor, tree in zip(anchors, trees) for token in (anchor, *tree.token_ids)]
    positions = [runner.context_rows + depth for runner, tree in zip(runners, trees)
                 for depth in tree.depths]
    for runner, (start, stop) in zip(runners, spans):
        torch_rollback.before_forward(runner.cache, stop - start)
    taps = next((runner.taps for runner in runners if runner.taps is not None), None)
    if taps is not None:
        taps.enabled = True
    ragged_rows = _ragged_rows(model, runners, trees, spans)  # before the attention switches
    with _ragged_attention_on(model):
        out = model(torch.tensor([ids], device=device), use_cache=True, logits_to_keep=0,
                    position_ids=torch.tensor([positions], device=device),
                    **{runners[0].cache_kwarg: RaggedCache([r.cache for r in runners], spans)},
                    ragged_rows=ragged_rows)
    batch_taps = taps.take() if taps is not None else None  # [1, sum N, taps*H]
    logits = out.logits[0].float().cpu().numpy()  # [sum N, V]
    for runner, (start, stop) in zip(runners, spans):
        runner.verified(stop - start, batch_taps[:, start:stop] if runner.taps is not None else None)
    return [logits[start:stop] for start, stop in spans]


def _ragged_rows(model, runners, trees, spans) -> RaggedRows:
    """Each runner's mask in the form the model's own attention function takes."""
    implementation = model.config._attn_implementation
    # the declared architectures' eager attention is the same function as Llama's
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
    additive = None if implementation != "eager" else model.get_input_embeddings().weight.dtype
    masks = tuple(_row_mask(runner.context_rows, tree, model.device, additive)
                  for runner, tree in zip(runners, trees))
    return RaggedRows(spans, masks, attend)


def _row_mask(past: int, tree: DraftTree, device, additive: torch.dtype | None):
    """[1, 1, rows, past + rows]: every row sees the cache and its own ancestors (a chain: the
    rows before it). Bool (True: may attend), or additive in that dtype (0: may attend) for eager
    attention, which adds the mask to the scores. A single row sees everything: no mask."""
    rows = len(tree.token_ids) + 1
    if rows == 1:
        return None
    allowed = torch.ones(1, 1, rows, past + rows, dtype=torch.bool)
    allowed[0, 0, :, past:] = torch.from_numpy(tree.ancestor_mask())
    if additive is None:
        return allowed.to(device)
    mask = torch.zeros(allowed.shape, dtype=additive)
    return mask.masked_fill_(~allowed, torch.finfo(additive).min).to(device)


@contextmanager
def _ragged_attention_on(model):
    """Run the model's attention through `ragged_attention` for one forward, then put back its
    own; the name has no mask function, so Transformers builds no mask for it."""
    config = model.config
    previous = config._attn_implementation
    AttentionInterface.register(RAGGED, ragged_attention)
    config._attn_implementation = RAGGED
    try:
        yield
    finally:
        config._attn_implementation = previous
        AttentionInterface._global_mapping.pop(RAGGED, None)
