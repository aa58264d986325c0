"""Several generations' verifies as one Transformers forward: ragged rows, not a padded batch.

Every runner's verify rows are concatenated into one sequence [1, sum N_i], so each linear
(attention projections, MLP, LM head) reads its weights once for all of them; each row carries
its own position (the runner's context length plus its depth in the tree). Attention is the one
step that stays per runner: `RaggedCache` appends each runner's new keys and values to that
runner's own cache, and `ragged_attention` attends each runner's query rows to the keys its cache
handed back, under that runner's chain or tree mask and, on a sliding-window layer, its window.
No key or value is copied into a shared batch.

Which targets batch (`can_batch`): those whose modeling hands the cache's keys straight to the
attention function and passes each layer's `sliding_window` to it (`RAGGED_MODEL_TYPES`), text
only, every layer full or sliding-window attention, with an attention kernel that takes any 4D
mask. Sliding-window targets (Mistral, Qwen2/Qwen3 with windowed layers, Gemma 3's text model)
batch chains and plain steps, as their own verify takes only those. Hybrid targets (Qwen3.5/3.6, Qwen3-Next) verify one
by one: a GatedDeltaNet layer is no attention over a cache, so the ragged split has nothing to
split; its recurrent state would have to run runner by runner row by row, which is most of the
layer's cost, and its past recording keeps one state per row of one sequence. Any other target,
and a batch of one, falls back to one verify per runner.

Afterwards each runner's state (pending taps, rows to roll back) is as its own verify sets it, so
`commit` works unchanged; a forward that fails part-way puts every runner's cache back to its
committed rows before the error goes on, so none is left holding some layers' new rows.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.cache_utils import get_layer_types_and_kwargs
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from dflash_local.accel.torch_attention import NAME as CPU_GQA_SDPA
from dflash_local.engines import torch_rollback
from dflash_local.method.draft_tree import DraftTree
from dflash_local.method.ragged import check_arguments, spans

RAGGED = "dflash_ragged_verify"  # registered only while a batched forward runs
# modeling files (Transformers' names) whose attention passes `cache.update`'s result, and the
# layer's `sliding_window`, to the attention function untouched
RAGGED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma3_text"})
RAGGED_LAYER_KINDS = frozenset({"full_attention", "sliding_attention"})
# attention implementations that take an arbitrary 4D mask as it is (flash kernels take none)
MASKED_ATTENTION = (None, "sdpa", CPU_GQA_SDPA, "eager")


@dataclass(frozen=True)
class RunnerRows:
    """One runner's rows in the batch: where they sit and what they may see."""

    span: tuple[int, int]  # its rows are [start, stop) of the batch
    past: int  # its committed rows: the anchor's position
    depths: np.ndarray  # [rows] each row's position after `past` (a chain: 0, 1, 2, ...)
    ancestors: np.ndarray  # [rows, rows] bool: row i may see row j (a chain: j <= i)


class RaggedRows:
    """Every runner's rows and the model's own attention function; each runner's mask is built
    once per shape of the keys its cache hands back (a full layer's, a sliding layer's)."""

    def __init__(self, runners: list[RunnerRows], attend: Callable, device,
                 additive: torch.dtype | None):
        self.runners, self.attend = runners, attend
        self.device, self.additive = device, additive
        self._masks: dict[tuple[int, int, int | None], torch.Tensor | None] = {}

    def mask(self, index: int, keys: int, window: int | None) -> torch.Tensor | None:
        key = (index, keys, window)
        if key not in self._masks:
            self._masks[key] = _row_mask(self.runners[index], keys, window, self.device,
                                         self.additive)
        return self._masks[key]


class RaggedCache:
    """Handed to the model as its cache: splits each layer's new keys and values by runner into
    that runner's own cache, and returns every runner's keys and values as lists."""

    def __init__(self, caches: Sequence, spans: Sequence[tuple[int, int]]):
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
                     scaling: float | None = None, sliding_window: int | None = None,
                     ragged_rows: RaggedRows | None = None, **kwargs):
    """Transformers' attention-function signature; query [1, heads, sum N, dim], one key and
    value tensor per runner, each attended through the model's own attention function under that
    runner's mask (`sliding_window`: this layer's, None on a full layer). Returns
    ([1, sum N, heads, dim], no weights)."""
    assert ragged_rows is not None, "ragged attention runs only inside verify_batch"
    outputs = [
        ragged_rows.attend(module, query[:, :, rows.span[0] : rows.span[1]], key, value,
                           ragged_rows.mask(index, key.shape[2], sliding_window), dropout=dropout,
                           scaling=scaling, sliding_window=sliding_window, **kwargs)[0]
        for index, (rows, key, value) in enumerate(zip(ragged_rows.runners, keys, values))
    ]
    return torch.cat(outputs, dim=1), None


def can_batch(runner) -> bool:
    """Whether this runner's target verifies as part of a ragged forward (the module's
    docstring): declared per architecture, text only, full or sliding-window layers only."""
    config = runner.model.config
    if (getattr(config, "model_type", None) not in RAGGED_MODEL_TYPES
            or getattr(config, "sub_configs", None)
            or getattr(config, "_attn_implementation", None) not in MASKED_ATTENTION):
        return False
    return set(get_layer_types_and_kwargs(config)[0]) <= RAGGED_LAYER_KINDS


def verify_batch(runners: Sequence, anchors: Sequence[int],
                 trees: Sequence[DraftTree]) -> list[np.ndarray]:
    """Each runner's `verify(anchor, tree)` as one forward; see TorchTargetRunner.verify_batch."""
    check_arguments("verify_batch", runners, "runner", {"anchors": anchors, "trees": trees},
                    lambda runner: runner.model, "model")
    if len(runners) < 2 or not can_batch(runners[0]) or not _verifies_as_its_own(runners, trees):
        return [runner.verify(anchor, tree) for runner, anchor, tree in zip(runners, anchors, trees)]
    return _ragged_verify(runners[0].model, runners, anchors, trees)


def _verifies_as_its_own(runners, trees) -> bool:
    """A runner without tree verify (sliding windows) verifies chains only, in a batch too."""
    return runners[0].supports_tree or all(tree.is_chain for tree in trees)


@torch.inference_mode()
def _ragged_verify(model, runners, anchors, trees) -> list[np.ndarray]:
    row_spans = spans([len(tree.token_ids) + 1 for tree in trees])
    ids = [token for anchor, tree in zip(anchors, trees) for token in (anchor, *tree.token_ids)]
    positions = [runner.context_rows + depth for runner, tree in zip(runners, trees)
                 for depth in tree.depths]
    ragged_rows = _ragged_rows(model, runners, trees, row_spans)  # before the attention switches
    taps = next((runner.taps for runner in runners if runner.taps is not None), None)
    for runner, (start, stop) in zip(runners, row_spans):
        torch_rollback.before_forward(runner.cache, stop - start)
    try:
        if taps is not None:
            taps.enabled = True
        with _ragged_attention_on(model):
            out = model(torch.tensor([ids], device=model.device), use_cache=True, logits_to_keep=0,
                        position_ids=torch.tensor([positions], device=model.device),
                        **{runners[0].cache_kwarg: RaggedCache([r.cache for r in runners], row_spans)},
                        ragged_rows=ragged_rows)
    except BaseException:
        _restore(runners, taps)
        raise
    batch_taps = taps.take() if taps is not None else None  # [1, sum N, taps*H]
    logits = out.logits[0].float().cpu().numpy()  # [sum N, V]
    for runner, (start, stop) in zip(runners, row_spans):
        runner.verified(stop - start, batch_taps[:, start:stop] if runner.taps is not None else None)
    return [logits[start:stop] for start, stop in row_spans]


def _restore(runners, taps) -> None:
    """After a forward that failed part-way (some layers hold this batch's rows, some not):
    every layer of every runner's cache back to the runner's committed rows, taps dropped."""
    if taps is not None:
        taps.stop()
    for runner in runners:
        for layer in runner.cache.layers:
            extra = layer.get_seq_length() - runner.context_rows
            if extra > 0:
                layer.crop(-extra)
        runner.verified(0, None)


def _ragged_rows(model, runners, trees, row_spans) -> RaggedRows:
    """Each runner's rows, masked in the form the model's own attention function takes."""
    implementation = model.config._attn_implementation
    # eager: the modeling file's own function (Gemma's takes a softcap, Llama's does not)
    own_eager = importlib.import_module(type(model).__module__).eager_attention_forward
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, own_eager)
    additive = None if implementation != "eager" else model.get_input_embeddings().weight.dtype
    rows = [RunnerRows(span, runner.context_rows, np.asarray(tree.depths), tree.ancestor_mask())
            for runner, tree, span in zip(runners, trees, row_spans)]
    return RaggedRows(rows, attend, model.device, additive)


def _row_mask(rows: RunnerRows, keys: int, window: int | None, device,
              additive: torch.dtype | None) -> torch.Tensor | None:
    """[1, 1, rows, keys] over the last `keys` positions of the runner's cache, its own rows
    last: every row sees the cached keys and its own ancestors; a sliding layer's `window` also
    hides a key at or before the row's position - window (Transformers' rule). Bool (True: may
    attend), or additive in that dtype (0: may attend) for eager attention, which adds the mask
    to the scores; None where every row sees every key."""
    count = len(rows.depths)
    allowed = np.ones((count, keys), dtype=bool)
    allowed[:, keys - count :] = rows.ancestors
    if window is not None:
        key_positions = np.arange(rows.past + count - keys, rows.past + count)
        allowed &= key_positions[None, :] > (rows.past + rows.depths)[:, None] - window
    if allowed.all():
        return None
    allowed_t = torch.from_numpy(allowed)[None, None]
    if additive is None:
        return allowed_t.to(device)
    mask = torch.zeros(allowed_t.shape, dtype=additive)
    return mask.masked_fill_(~allowed_t, torch.finfo(additive).min).to(device)


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
