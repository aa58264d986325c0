"""The Transformers engine: target via AutoModelForCausalLM, our torch drafter, our loop.

Taps come from forward hooks on just the tapped decoder layers (no output_hidden_states, which
keeps every layer's output alive). The target cache is rolled back by cropping; sliding-window
and GatedDeltaNet layers (Gemma 3/4, gpt-oss, Qwen3.5/3.6, Qwen3-Next) record their past through
each forward so that the crop can restore them (engines/torch_rollback.py), and a target whose
layers cannot be rolled back is refused from its config before it loads. On a CPU the
engine installs the grouped-query attention and packs the linears at load (dflash_local/accel/).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from dflash_local.accel import Installed, torch_attention, uninstall_all
from dflash_local.accel.torch_linear import (
    DEFAULT_ROWS_HINT,
    install_causal_lm,
    pack_linear,
    pack_linears,
)
from dflash_local.drafter.config import DrafterConfig
from dflash_local.drafter.model_torch import DraftSession, load_drafter
from dflash_local.engines import torch_batch, torch_rollback
from dflash_local.engines.local import LocalEngine
from dflash_local.engines.table import TRANSFORMERS
from dflash_local.engines.torch_prefix import TorchPrefixCodec, TorchPrefixStates, row_bytes
from dflash_local.errors import CheckpointError
from dflash_local.method.draft_tree import DraftTree

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def decoder_stack(model) -> torch.nn.Module:
    """The target's decoder (with `.layers` and `.norm`), by architecture family."""
    inner = model.model
    if hasattr(inner, "language_model"):  # multimodal wrappers (Qwen3.5, Gemma 3/4)
        inner = inner.language_model
    if not hasattr(inner, "layers"):
        raise CheckpointError(f"no decoder layer list found in {type(model).__name__}")
    return inner


def decoder_layers(model) -> torch.nn.ModuleList:
    return decoder_stack(model).layers


class TapCollector:
    """Forward hooks on the tapped layers; collects only while `enabled`.

    Tap i is HF `hidden_states[i + 1]`, which z-lab trained on; for the last layer HF reports
    the final-normed state, so that tap hooks the final norm instead of the layer.
    """

    def __init__(self, model, layer_ids: tuple[int, ...]):
        self.layer_ids = layer_ids
        self.enabled = False
        self.outputs: dict[int, torch.Tensor] = {}
        stack = decoder_stack(model)
        last = len(stack.layers) - 1
        modules = {i: stack.norm if i == last else stack.layers[i] for i in layer_ids}
        self._handles = [module.register_forward_hook(self._hook(i)) for i, module in modules.items()]

    def _hook(self, layer_id: int):
        def capture(_module, _inputs, output):
            if self.enabled:
                self.outputs[layer_id] = output[0] if isinstance(output, tuple) else output
        return capture

    def remove(self) -> None:
        """Unhook the layers (a model that outlives this collector must not keep its hooks)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def stop(self) -> None:
        """Stop collecting and drop what a forward that failed part-way collected."""
        self.outputs.clear()
        self.enabled = False

    def take(self) -> torch.Tensor:
        """[1, rows, taps*H]: tap i = output of decoder layer i (HF hidden_states[i + 1])."""
        taps = torch.cat([self.outputs[i] for i in self.layer_ids], dim=-1)
        self.outputs.clear()
        self.enabled = False
        return taps


class TorchTargetRunner:
    """The `interfaces.TargetRunner` interface for one generation."""

    def __init__(self, model, taps: TapCollector | None, max_context: int):
        self.model = model
        self.taps = taps
        self.max_context = max_context
        self.supports_tree = supports_tree(model.config)
        self.cache = DynamicCache(config=model.config)
        self.cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._length = 0
        self._verified_rows = 0
        self._pending_taps: torch.Tensor | None = None

    @torch.inference_mode()
    def _forward(self, ids: list[int], logits_to_keep: int, rollback_rows: int = 0, **tree_inputs):
        """`rollback_rows`: how many of the rows a later `_keep` may drop (recorded per row)."""
        if self.taps is not None:
            self.taps.enabled = True
        torch_rollback.before_forward(self.cache, rollback_rows)
        input_ids = torch.tensor([ids], device=self.model.device)
        out = self.model(input_ids, use_cache=True, logits_to_keep=logits_to_keep,
                         **{self.cache_kwarg: self.cache}, **tree_inputs)
        taps = self.taps.take() if self.taps is not None else None
        return out.logits[0].float().cpu().numpy(), taps

    def prefill(self, prompt_ids: list[int], start: int = 0):
        """`start`: rows already in the cache (restored by engines/torch_prefix.py)."""
        logits, taps = self._prefill(prompt_ids, start, logits_to_keep=1)
        return logits[-1], taps

    def prefill_scored(self, prompt_ids: list[int], start: int) -> tuple[np.ndarray, Any]:
        """As `prefill`, with every run row's logits [rows, V]: a prompt's own
        log-probabilities (engines/prompt_scores.py, which bounds the rows per call)."""
        return self._prefill(prompt_ids, start, logits_to_keep=0)

    def _prefill(self, prompt_ids: list[int], start: int, logits_to_keep: int):
        logits, taps = self._forward(prompt_ids[start:], logits_to_keep=logits_to_keep)
        torch_rollback.keep_rows(self.cache, 0)  # drop the record of the prompt
        self._length = len(prompt_ids)
        return logits, taps

    def verify(self, anchor_id: int, tree: DraftTree) -> np.ndarray:
        if tree.is_chain:
            return self.verify_chain([anchor_id, *tree.token_ids])
        return self.verify_tree(anchor_id, tree)

    @staticmethod
    def verify_batch(runners: list[TorchTargetRunner], anchors: list[int],
                     trees: list[DraftTree]) -> list[np.ndarray]:
        """Each runner's verify(anchor, tree) as one batched forward: afterwards each runner is in
        the state its own verify leaves (cache rows appended, pending taps, rollback records:
        ready for commit), and each logits [N_i+1, V] is what its verify returns (same argmax).
        Runners of one model; targets that cannot batch fall back to one verify each
        (engines/torch_batch.py)."""
        return torch_batch.verify_batch(runners, anchors, trees)

    def verify_chain(self, block_ids: list[int]) -> np.ndarray:
        """The rows as one causal sequence after the cache: the cheaper verify of a chain."""
        logits, taps = self._forward(block_ids, logits_to_keep=0, rollback_rows=len(block_ids))
        self.verified(len(block_ids), taps)
        return logits

    @property
    def context_rows(self) -> int:
        """Committed rows in the cache: where the next verify's anchor sits."""
        return self._length

    def verified(self, rows: int, taps: torch.Tensor | None) -> None:
        """Record a verify of `rows` rows on top of the cache (run here or in a batch) and its
        taps [1, rows, taps*H], for `commit`."""
        self._verified_rows, self._pending_taps = rows, taps

    def _keep(self, kept_rows: int):
        torch_rollback.keep_rows(self.cache, self._verified_rows - kept_rows)
        self._length += kept_rows
        taps = self._pending_taps
        return taps[:, :kept_rows] if taps is not None else None

    def verify_tree(self, anchor_id: int, tree: DraftTree) -> np.ndarray:
        """Rows at the positions of their depths; each sees the cache and its own ancestors
        (a 4D mask, which Transformers passes to attention as it is)."""
        device = self.model.device
        past = self._length
        rows = len(tree.token_ids) + 1
        # additive (0 = may attend): eager attention adds the mask to the scores, sdpa takes either
        dtype = self.model.get_input_embeddings().weight.dtype
        mask = torch.zeros(1, 1, rows, past + rows, dtype=dtype, device=device)
        hidden = torch.from_numpy(~tree.ancestor_mask()).to(device)
        mask[0, 0, :, past:].masked_fill_(hidden, torch.finfo(dtype).min)
        positions = torch.tensor([tree.depths], device=device) + past
        logits, taps = self._forward(
            [anchor_id, *tree.token_ids], logits_to_keep=0, attention_mask=mask,
            position_ids=positions, cache_position=torch.arange(past, past + rows, device=device))
        self.verified(rows, taps)
        return logits

    @torch.inference_mode()
    def commit(self, rows: list[int]):
        """Move the kept rows' keys, values and taps to the front of the last verify's rows;
        `_keep` then keeps them and drops the rest."""
        if rows != list(range(len(rows))):
            index = torch.tensor(rows, device=self.model.device)
            past = self._length
            for layer in self.cache.layers:
                for tensor in (layer.keys, layer.values):
                    tensor[:, :, past : past + len(rows)] = tensor.index_select(2, index + past)
            if self._pending_taps is not None:
                self._pending_taps = self._pending_taps[:, index]
        return self._keep(len(rows))

    def join_taps(self, chunks: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(chunks, dim=1)


def supports_tree(config) -> bool:
    """Tree verification passes one mask for every layer: only where every layer is full causal
    attention (no sliding windows, no recurrent layers) whose kernel takes a 4D mask as it is."""
    if getattr(config, "_attn_implementation", None) not in torch_batch.MASKED_ATTENTION:
        return False  # flash attention kernels take no arbitrary mask
    text = getattr(config, "text_config", None) or config
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None:
        return set(layer_types) == {"full_attention"}
    return not getattr(text, "sliding_window", None)


def context_of(config) -> int:
    """The context the engine declares: the language model's (multimodal: its text config's);
    a config without one, 32768."""
    text_config = config.get_text_config(decoder=True)
    return int(getattr(text_config, "max_position_embeddings", 0) or 32768)


def _load_target(target_path: Path, config, dtype: torch.dtype, device: str):
    """Tokenizer and model (of `config`, already read and checked); a partial or corrupt
    directory is a CheckpointError, not a traceback."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(target_path, config=config)
        model = AutoModelForCausalLM.from_pretrained(target_path, config=config, dtype=dtype)
    except (OSError, ValueError, KeyError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"cannot load target from {target_path}: {first_line}") from None
    return tokenizer, model.to(device).eval()


class TorchEngine(LocalEngine):
    name = TRANSFORMERS.name
    dtypes = DTYPES
    taps: TapCollector | None = None  # hooks on the layers the drafter reads (None: no drafter)

    def __init__(self, target_path: Path, drafter_path: Path | None, *, device: str = "cpu",
                 pack_cpu_linears: bool = True, **local_options):
        """`device`: torch's; `pack_cpu_linears=False`: stock PyTorch linears
        (scripts/experiments/torch_verify_cost.py compares); `local_options`: LocalEngine's keywords."""
        self.device = device
        self.pack_cpu_linears = pack_cpu_linears
        super().__init__(target_path, drafter_path, **local_options)

    def on_accelerator(self) -> bool:
        return self.device != "cpu"

    def target_context(self, target_path: Path, raw_config: dict) -> int:
        """A target whose layers cannot be rolled back is refused (engines/torch_rollback.py)."""
        self.target_config = torch_rollback.checked_config(target_path, raw_config)  # loaded
        return context_of(self.target_config)

    def load_target(self, target_path: Path, dtype: str):
        tokenizer, self.model = _load_target(target_path, self.target_config, DTYPES[dtype],
                                            self.device)
        return tokenizer

    def install_accelerations(self, drafter_config: DrafterConfig | None) -> list[Installed]:
        """The CPU attention, and the linears packed for a verify of the drafter's block."""
        accelerations = [torch_attention.install(self.model)]
        self.rows_hint = drafter_config.block_size if drafter_config else DEFAULT_ROWS_HINT
        # not among what close() uninstalls: see there
        self.packed = (install_causal_lm(self.model, self.rows_hint) if self.pack_cpu_linears
                       else Installed("torch_linear"))
        return accelerations

    def load_bound_drafter(self, drafter_path: Path, drafter_config: DrafterConfig, dtype: str,
                     draft_ids: list[int] | None, weights: dict | None = None):
        drafter = load_drafter(drafter_path, dtype=DTYPES[dtype], device=self.device, weights=weights)
        if self.pack_cpu_linears:
            pack_linears(drafter, self.rows_hint)
        drafter.bind(self.model.get_input_embeddings(), self.model.get_output_embeddings())
        if draft_ids:
            wrap = partial(pack_linear, rows_hint=self.rows_hint) if self.pack_cpu_linears else None
            drafter.restrict_draft_vocab(draft_ids, wrap=wrap)
        if self.taps is not None:  # a swapped drafter (local.swap_drafter): one set of hooks
            self.taps.remove()
        self.taps = TapCollector(self.model, drafter_config.target_layer_ids)
        return drafter

    def torch_target(self):
        return self.model

    def exact_tree_verify(self) -> bool:
        return supports_tree(self.model.config)

    def kept_row_bytes(self, raw_config: dict, dtype: str, taps: int) -> int:
        return row_bytes(self.model, taps)

    def make_prefix_states(self) -> TorchPrefixStates:
        return TorchPrefixStates()

    def make_prefix_codec(self) -> TorchPrefixCodec:
        return TorchPrefixCodec(self.device)

    def compute_threads(self) -> int | None:
        return torch.get_num_threads() if self.model.device.type == "cpu" else None

    def close(self) -> None:
        """Switch the target back to "sdpa" and unregister ours when no other model runs it.
        The packed linears stay: they are this engine's own model, released with it (unpacking
        would cost a matmul per layer; `self.packed.uninstall()` does it for who keeps the model)."""
        uninstall_all(self.accelerations)
        super().close()

    def make_runner(self, collect_taps: bool) -> TorchTargetRunner:
        return TorchTargetRunner(self.model, self.taps if collect_taps else None,
                                 self.capabilities.max_context)

    def make_drafter(self, window: int | None = None) -> DraftSession | None:
        if self.drafter is None:
            return None
        return DraftSession(self.drafter, window=window or self.draft_window)

    def batched_calls(self) -> tuple[Callable, Callable]:
        """The batched verify and drafter pass the worker's lanes run (calibration times them)."""
        return TorchTargetRunner.verify_batch, DraftSession.propose_batch
