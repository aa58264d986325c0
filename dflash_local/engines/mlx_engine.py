"""The MLX engine: target via mlx-lm, our MLX drafter, our loop (the default engine).

Taps come from running the target's layers in an explicit loop (engines/mlx_adapters.py).
Rollback after a partial acceptance: attention caches are trimmed (mlx-lm's trimmable caches);
the GatedDeltaNet states of hybrid targets are restored to their pre-verify values and the
accepted rows are replayed through the layer's own module. On Linux a fast BLAS must be loaded
before mlx is imported (accel/blas.py; `engine_class_for("mlx")` installs it before importing
this module): the wheel's reference BLAS makes verify ~10x dearer. The engine installs the CPU
attention and the per-row RoPE on its target at load and uninstalls them in `close()`.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_lm_load
from mlx_lm.models.cache import trim_prompt_cache

from dflash_local.accel import Installed, blas, mlx_attention, uninstall_all
from dflash_local.accel.mlx_lanes import Lane
from dflash_local.drafter.config import DrafterConfig, load_target_info, model_type_of
from dflash_local.drafter.model_mlx import DraftSession, load_drafter
from dflash_local.engines import mlx_batch
from dflash_local.engines.local import LocalEngine
from dflash_local.engines.mlx_adapters import LayerRun, TargetAdapter, adapter_for
from dflash_local.engines.mlx_prefix import MLXPrefixCodec, MLXPrefixStates
from dflash_local.engines.table import MLX
from dflash_local.errors import InvalidRequestError
from dflash_local.method.draft_tree import DraftTree
from dflash_local.pairs.memory_fit import config_quantized, prefix_row_bytes

logger = logging.getLogger(__name__)

# in the order an error lists them
DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}
PREFILL_STEP = 2048  # prompt rows per forward, as mlx-lm's generate: bounds prefill memory


@dataclass
class _Verified:
    """What commit() needs from the last verify."""

    width: int
    taps: mx.array | None
    recurrent_inputs: dict[int, mx.array]
    recurrent_states: dict[int, list]


class MLXTargetRunner:
    """The `interfaces.TargetRunner` interface for one generation (owns the target cache).
    A chain is verified as one causal sequence; any other tree with a mask (`verify_tree`)."""

    def __init__(self, model, adapter: TargetAdapter, tap_ids: tuple[int, ...] | None,
                 max_context: int):
        self.model = model
        self.adapter = adapter
        self.tap_ids = tap_ids
        self.max_context = max_context
        self.cache = adapter.make_cache(model)
        self._layers = adapter.text_model(model).layers
        self._recurrent = [i for i, layer in enumerate(self._layers) if adapter.is_recurrent(layer)]
        self._verified: _Verified | None = None
        self.supports_tree = verifies_trees(model, adapter)

    @property
    def hybrid(self) -> bool:
        """Recurrent layers: their state cannot be trimmed, only restored and replayed."""
        return bool(self._recurrent)

    def _run(self, token_ids: list[int], record_recurrent: bool = False, mask: mx.array | None = None):
        run = self.adapter.run(self.model, mx.array([token_ids]), self.cache,
                               frozenset(self.tap_ids or ()), record_recurrent, mask)
        return run, self._taps(run)

    def _taps(self, run, rows: slice | None = None):
        """This runner's taps of `run` (`rows`: its rows of a batched verify's run)."""
        if self.tap_ids is None:
            return None
        taps = [run.taps[i] if rows is None else run.taps[i][:, rows] for i in self.tap_ids]
        return mx.concatenate(taps, axis=-1)

    def prefill(self, prompt_ids: list[int], start: int = 0):
        """`start`: rows already in the cache (restored by engines/mlx_prefix.py)."""
        if len(prompt_ids) <= start:
            raise InvalidRequestError(f"the prompt has {len(prompt_ids)} tokens, {start} of them "
                                      f"cached: nothing to prefill")
        chunks = []
        for chunk_start in range(start, len(prompt_ids), PREFILL_STEP):
            run, taps = self._run(prompt_ids[chunk_start : chunk_start + PREFILL_STEP])
            mx.eval(run.hidden, taps, [c.state for c in self.cache])
            chunks.append(taps)
        logits = self.adapter.logits(self.model, run.hidden[:, -1:]).astype(mx.float32)
        taps = mx.concatenate(chunks, axis=1) if self.tap_ids is not None else None
        return np.array(logits[0, -1]), taps

    def prefill_scored(self, prompt_ids: list[int], start: int) -> tuple[np.ndarray, Any]:
        """As `prefill` in one forward, with every run row's logits [rows, V]: a prompt's own
        log-probabilities (engines/prompt_scores.py, which bounds the rows per call)."""
        run, taps = self._run(prompt_ids[start:])
        logits = self.adapter.logits(self.model, run.hidden).astype(mx.float32)
        mx.eval(logits, taps, [c.state for c in self.cache])
        return np.array(logits[0]), taps

    def verify(self, anchor_id: int, tree: DraftTree) -> np.ndarray:
        if tree.is_chain:
            return self.verify_chain([anchor_id, *tree.token_ids])
        return self.verify_tree(anchor_id, tree)

    def verify_chain(self, block_ids: list[int]) -> np.ndarray:
        """The rows as one causal sequence after the cache: the cheaper verify of a chain."""
        states = {i: list(self.cache[i].cache) for i in self._recurrent}
        run, taps = self._run(block_ids, record_recurrent=bool(self._recurrent))
        logits = self.adapter.logits(self.model, run.hidden).astype(mx.float32)
        mx.eval(logits, taps)
        self._verified = _Verified(len(block_ids), taps, run.recurrent_inputs, states)
        return np.array(logits[0])

    def verify_tree(self, anchor_id: int, tree: DraftTree) -> np.ndarray:
        """The anchor and the nodes go through the layers as one sequence, as a chain verify's
        rows, with two differences: each row sits at the RoPE position of its depth, and the mask
        leaves it the cache and its own ancestors."""
        past = self.cache[0].offset
        rows = len(tree.token_ids) + 1
        cache = self.adapter.rows_at_positions(self.cache, mx.array(tree.depths) + past)
        run = self.adapter.run(self.model, mx.array([[anchor_id, *tree.token_ids]]), cache,
                               frozenset(self.tap_ids or ()), mask=_tree_mask(tree, past))
        taps = self._taps(run)
        logits = self.adapter.logits(self.model, run.hidden).astype(mx.float32)
        mx.eval(logits, taps)
        self._verified = _Verified(rows, taps, {}, {})
        return np.array(logits[0])

    @staticmethod
    def verify_batch(runners: list[MLXTargetRunner], anchors: list[int],
                     trees: list[DraftTree]) -> list[np.ndarray]:
        """Each runner's verify(anchor, tree) as one batched forward: afterwards each runner is
        in the state its own verify leaves (ready for commit), and each logits [N_i+1, V] is what
        its verify returns. Runners of one model; a target that cannot batch (engines/mlx_batch.py
        says which) is verified runner by runner."""
        return mlx_batch.verify_batch(runners, anchors, trees)

    def lane(self, anchor_id: int, tree: DraftTree) -> Lane:
        """This runner's rows in a batched verify, placed and masked as `verify` runs them."""
        past = self.cache[0].offset
        token_ids = [anchor_id, *tree.token_ids]
        if tree.is_chain:
            mask = "causal" if len(token_ids) > 1 else None
        else:
            mask = _tree_mask(tree, past)
        return Lane(self.cache, token_ids, mx.array(tree.depths) + past, mask)

    def take_lane(self, run: LayerRun, rows: slice) -> mx.array | None:
        """Hold this runner's `rows` of a batched verify's run as its own verify's, for commit;
        their taps."""
        taps = self._taps(run, rows)
        self._verified = _Verified(rows.stop - rows.start, taps, {}, {})
        return taps

    def drop_verified(self) -> None:
        """Hold nothing for commit: a batched verify that failed put the cache back instead."""
        self._verified = None

    def commit(self, rows: list[int]):
        """Move the kept rows' keys and values to the positions after the cache; `_keep`
        then trims the rest."""
        if rows != list(range(len(rows))):
            past = self.cache[0].offset - self._verified.width
            index = mx.array(rows) + past
            for layer_cache in self.cache:
                for name in ("keys", "values"):
                    stored = getattr(layer_cache, name)
                    stored[:, :, past : past + len(rows)] = stored[:, :, index]
            mx.eval([layer_cache.state for layer_cache in self.cache])
            if self._verified.taps is not None:
                self._verified.taps = self._verified.taps[:, mx.array(rows)]
        return self._keep(len(rows))

    def _keep(self, kept_rows: int):
        verified, self._verified = self._verified, None
        rejected = verified.width - kept_rows
        if rejected > 0:
            self._roll_back(verified, kept_rows, rejected)
        return verified.taps[:, :kept_rows] if verified.taps is not None else None

    def join_taps(self, chunks: list[mx.array]) -> mx.array:
        return mx.concatenate(chunks, axis=1)

    def _roll_back(self, verified: _Verified, kept_rows: int, rejected: int) -> None:
        if not self._recurrent:
            trim_prompt_cache(self.cache, rejected)
            return
        for index, layer_cache in enumerate(self.cache):
            if index not in verified.recurrent_states:
                layer_cache.trim(rejected)
                continue
            for slot, value in enumerate(verified.recurrent_states[index]):
                layer_cache[slot] = value
            layer_input = verified.recurrent_inputs[index][:, :kept_rows]
            self.adapter.replay_recurrent(self._layers[index], layer_input, layer_cache)
        mx.eval([self.cache[i].state for i in self._recurrent])


def _tree_mask(tree: DraftTree, past: int) -> mx.array:
    """[rows, past + rows] bool: each row sees the cache, itself and its ancestors."""
    rows = len(tree.token_ids) + 1
    return mx.concatenate([mx.ones((rows, past), dtype=mx.bool_), mx.array(tree.ancestor_mask())],
                          axis=1)


def verifies_trees(model, adapter: TargetAdapter) -> bool:
    """Whether a tree verify is exact on this target: no recurrent layer (their state would see
    every row in order) and every layer full attention with a per-row RoPE."""
    layers = adapter.text_model(model).layers
    return not any(adapter.is_recurrent(layer) for layer in layers) and adapter.can_verify_trees(model)


def _cast_floating(model, dtype: mx.Dtype) -> None:
    """Cast floating weights, except those mlx-lm keeps as they are (Qwen3.5's A_log)."""
    keep_as_is = getattr(model, "cast_predicate", None)  # mlx-lm's own optional hook
    weights = [
        (path, value.astype(dtype)) for path, value in tree_flatten(model.parameters())
        if mx.issubdtype(value.dtype, mx.floating) and value.dtype != dtype
        and (keep_as_is is None or keep_as_is(path))
    ]
    if weights:
        model.load_weights(weights, strict=False)
        mx.eval(model.parameters())


def _precision_warnings(dtype: str, quantized: bool) -> list[str]:
    notes = []
    on_cpu = mx.default_device() == mx.cpu
    if on_cpu and dtype != "float32":
        notes.append(f"the drafter and target run in {dtype} on MLX's CPU backend, which has no "
                     "fast half-precision matmul: float32 is faster there")
    if quantized:
        notes.append("quantized target: its verify matmul grows dearer with block width than a "
                     "bf16 one; measure, or use a smaller block size")
        if on_cpu:
            notes.append("quantized target on MLX's CPU backend: quantized matmuls do not use "
                         "BLAS there and are slow; prefer a float32/bf16 target on Linux")
    return notes


class MLXEngine(LocalEngine):
    name = MLX.name
    dtypes = DTYPES
    tap_ids: tuple[int, ...] | None = None  # the target layers the drafter reads (None: no drafter)

    def on_accelerator(self) -> bool:
        return mx.default_device() != mx.cpu

    def target_context(self, target_path: Path, raw_config: dict) -> int:
        """A config without a context: 32768. An architecture without an adapter is refused."""
        if sys.platform.startswith("linux") and blas.loaded_library() is None:
            blas.blas_status(warn=True)  # mlx came first or no OpenBLAS: say why verify is slow
        target_info = load_target_info(target_path, raw_config)
        self.adapter = adapter_for(model_type_of(raw_config))
        return target_info.max_position_embeddings or 32768

    def warn_precision(self, dtype: str, raw_config: dict) -> None:
        for note in _precision_warnings(dtype, config_quantized(raw_config)):
            logger.warning(note)

    def load_target(self, target_path: Path, dtype: str):
        self.model, wrapper = mlx_lm_load(str(target_path))
        _cast_floating(self.model, DTYPES[dtype])  # quantized: scales, norms (packed ints stay)
        return wrapper._tokenizer

    def install_accelerations(self, drafter_config: DrafterConfig | None) -> list[Installed]:
        return [mlx_attention.install(self.model), self.adapter.install_row_rope(self.model)]

    def load_bound_drafter(self, drafter_path: Path, drafter_config: DrafterConfig, dtype: str,
                     draft_ids: list[int] | None, weights: dict | None = None):
        drafter = load_drafter(drafter_path, dtype=DTYPES[dtype], in_memory=weights)
        inner = self.adapter.text_model(self.model)
        drafter.bind(inner.embed_tokens, self.adapter.lm_head(self.model))
        if draft_ids:
            drafter.restrict_draft_vocab(draft_ids)
        self.tap_ids = drafter_config.target_layer_ids
        return drafter

    def exact_tree_verify(self) -> bool:
        return verifies_trees(self.model, self.adapter)

    def kept_row_bytes(self, raw_config: dict, dtype: str, taps: int) -> int:
        return prefix_row_bytes(raw_config, DTYPES[dtype].size, taps)

    def make_prefix_states(self) -> MLXPrefixStates:
        return MLXPrefixStates()

    def make_prefix_codec(self) -> MLXPrefixCodec:
        return MLXPrefixCodec()

    def choose_threads(self) -> None:
        blas.choose_threads(self._decode_probe)  # Linux with our OpenBLAS only

    def _decode_probe(self) -> None:
        """A 1-row step and a 16-row verify through the decoding path: what the thread count is for."""
        runner = self.make_runner(collect_taps=False)
        runner.prefill([0])
        runner.verify_chain([0] * 16)

    def compute_threads(self) -> int | None:
        return blas.blas_threads()

    def close(self) -> None:
        """Put back what the engine installed on its target and in mlx-lm's modules (the BLAS
        stays: libmlx is bound to it for the life of the process)."""
        uninstall_all(self.accelerations)
        super().close()

    def make_runner(self, collect_taps: bool) -> MLXTargetRunner:
        tap_ids = self.tap_ids if collect_taps else None
        return MLXTargetRunner(self.model, self.adapter, tap_ids, self.capabilities.max_context)

    def make_drafter(self, window: int | None = None) -> DraftSession | None:
        if self.drafter is None:
            return None
        return DraftSession(self.drafter, window=window or self.draft_window)

    def batched_calls(self) -> tuple[Callable, Callable]:
        """The batched verify and drafter pass the worker's lanes run (calibration times them)."""
        return MLXTargetRunner.verify_batch, DraftSession.propose_batch
