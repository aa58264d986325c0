"""Adaptation's torch parts: the target's taps of a recorded reply, a training step of the
candidate drafter, and teacher-forced acceptance, each small enough to be one idle slice.

Boundary: tensors only; which reply, when, and whether a candidate serves is `adapt/idle.py`'s.
Torch trains for both engines: the loss, the batches and the selector's training exist once
(train/), it runs on CUDA, on MPS on a Mac and on CPUs, and its output is z-lab's checkpoint
format, which the MLX engine loads as it is. The transformers engine lends its own target; the
MLX engine's target is loaded once more in torch (`TorchTeacher.load`).

Forgetting: the shipped embedded drafter replays its own training data (models/training-data:
its sequences, retapped here) beside the user's replies; a downloaded drafter, whose data we do
not have, is pulled toward its shipped weights (an L2 term) instead.
"""

from __future__ import annotations

import inspect
import logging
import math
import random
import shutil
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_local.drafter.draft_vocab import FILE_NAME as DRAFT_VOCAB_FILE
from dflash_local.drafter.model_torch import DFlashDrafter, load_drafter, save_drafter
from dflash_local.engines.torch_engine import TapCollector
from dflash_local.errors import check_fields
from dflash_local.train.batches import make_batch
from dflash_local.train.trainer import accepted_per_block, loss_and_predictions

log = logging.getLogger("dflash_local.adapt")


@dataclass(frozen=True)
class AdaptSettings:
    # of those tried, the one that gains on the user's kind and keeps the general τ (>= 0.95x):
    # docs/records/adapt-tune-embedded.json (after 100 replies no setting tried does better:
    # adapt-tune-100-replies.json)
    lr: float = 3e-5
    gamma: float = 7.0
    max_prompt_tokens: int = 256  # a reply's context is cut to the prompt's last tokens
    max_reply_tokens: int = 256
    pull: float = 1.0  # the L2 pull toward the shipped weights (a drafter without replay data)
    replay_share: float = 0.5  # of the steps, those that add one sequence of the shipped data
    seed: int = 0

    def __post_init__(self):
        check_fields(self, {
            "lr": (lambda value: 0 <= value <= 0.1, "a learning rate in [0, 0.1]"),
            "gamma": (lambda value: 0 < value < math.inf, "a decay length > 0"),
            "max_prompt_tokens": (lambda value: isinstance(value, int) and value >= 1, "an int >= 1"),
            "max_reply_tokens": (lambda value: isinstance(value, int) and value >= 2,
                                 "an int >= 2 (a block needs an anchor and a draft)"),
            "pull": (lambda value: 0 <= value < math.inf, "a weight >= 0"),
            "replay_share": (lambda value: 0 <= value <= 1, "a share in [0, 1]")})


def training_sequence(prompt_ids: list[int], reply_ids: list[int], settings: AdaptSettings) -> dict:
    """A recorded reply as a training sequence ({"tokens", "prompt_len"}), cut to the budgets."""
    prompt = prompt_ids[-settings.max_prompt_tokens:]
    tokens = prompt + reply_ids[: settings.max_reply_tokens]
    return {"tokens": torch.tensor(tokens, dtype=torch.int32), "prompt_len": len(prompt)}


def replay_sequences(drafter_path: Path, tokenizer, target_path: Path, settings: AdaptSettings,
                     count: int) -> list[dict]:
    """A seeded sample of `count` sequences of the shipped drafter's own training data
    (models/training-data, beside it), cut as replies are; [] for a drafter that ships none (a
    downloaded one) or an archive of another target."""
    from dflash_local import paths
    from dflash_local.drafter.config import load_target_info
    from dflash_local.errors import CheckpointError
    from dflash_local.train.token_archive import load_tokens, target_fingerprint

    shipped = paths.shipped_models_dir().resolve()
    if Path(drafter_path).resolve().parent != shipped:
        return []
    fingerprint = target_fingerprint(load_target_info(target_path))
    sequences: list[dict] = []
    for archive in sorted((shipped / "training-data").glob("*.npz")):
        try:
            sequences += load_tokens(archive, tokenizer, fingerprint)
        except CheckpointError as exc:  # another target's data: no replay from it
            log.info("no replay from %s: %s", archive.name, exc)
    sample = random.Random(settings.seed).sample(sequences, min(count, len(sequences)))
    return [training_sequence(s["tokens"][: s["prompt_len"]].tolist(),
                              s["tokens"][s["prompt_len"]:].tolist(), settings) for s in sample]


def frozen_borrowed(model) -> tuple[torch.nn.Embedding, torch.nn.Linear]:
    """The target's embeddings and head as the drafter borrows them to train: the same weights,
    frozen (no gradient for the target's tables), and the head as a stock linear (the engine's
    oneDNN-packed one has no backward)."""
    from dflash_local.accel.torch_linear import PackedLinear

    head = model.get_output_embeddings()
    if isinstance(head, PackedLinear):
        head = head.unpacked()
    frozen_head = torch.nn.Linear(head.in_features, head.out_features, bias=head.bias is not None,
                                  device="meta")
    frozen_head.weight = torch.nn.Parameter(head.weight.detach(), requires_grad=False)
    if head.bias is not None:
        frozen_head.bias = torch.nn.Parameter(head.bias.detach(), requires_grad=False)
    table = model.get_input_embeddings().weight.detach()
    return torch.nn.Embedding.from_pretrained(table, freeze=True), frozen_head


def torch_device() -> str:
    """Where the trainer runs beside an engine that lends no torch target: CUDA, else MPS."""
    if torch.cuda.is_available():
        return "cuda"
    return "mps" if torch.backends.mps.is_available() else "cpu"


class TorchTeacher:
    """The target in torch: the taps of a sequence, computed a chunk of rows at a time."""

    def __init__(self, model, tap_ids: tuple[int, ...]):
        self.model = model
        self.tap_ids = tap_ids
        self.device = next(model.parameters()).device

    @classmethod
    def load(cls, target_path: Path, tap_ids: tuple[int, ...], device: str) -> TorchTeacher:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32)
        return cls(model.to(device).eval(), tap_ids)

    def taps(self, tokens: torch.Tensor, chunk_rows) -> Generator[None, None, torch.Tensor]:
        """[rows, taps*H] bfloat16 for every token but the last (never fed back); yields after
        each chunk of `chunk_rows()` rows, through a KV cache kept across the chunks."""
        from transformers import DynamicCache

        ids = tokens[:-1].long().to(self.device)[None]
        cache, pieces, start = DynamicCache(), [], 0
        # newer Transformers name the cache argument `cache` (the engine's runner asks the same way)
        cache_kwarg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        collector = TapCollector(self.model, self.tap_ids)
        try:
            while start < ids.shape[1]:
                end = start + max(1, chunk_rows())
                with torch.inference_mode():
                    collector.enabled = True
                    self.model(ids[:, start:end], use_cache=True, logits_to_keep=1,
                               **{cache_kwarg: cache})
                    pieces.append(collector.take()[0].to(torch.bfloat16).cpu())
                start = end
                yield
        finally:
            collector.remove()  # the model outlives this reply: no hook of ours stays on it
        return torch.cat(pieces)


class DrafterTrainer:
    """The candidate being trained, the shipped weights (pull and reset), and a scorer module
    that holds whichever weights are being judged."""

    def __init__(self, shipped_path: Path, teacher_model, draft_ids: list[int] | None,
                 settings: AdaptSettings, pull: bool):
        self.shipped_path = shipped_path
        self.settings = settings
        self.pull = pull
        self.rng = random.Random(settings.seed)
        borrowed = frozen_borrowed(teacher_model)
        self.candidate = self._bound(shipped_path, borrowed, draft_ids).train()
        self.scorer = self._bound(shipped_path, borrowed, draft_ids)
        self.shipped = _copy(self.candidate)
        self.serving = self.shipped
        self._params = [p for p in self.candidate.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self._params, lr=settings.lr, betas=(0.9, 0.95),
                                           weight_decay=0.0)

    @staticmethod
    def _bound(path: Path, borrowed: tuple, draft_ids: list[int] | None) -> DFlashDrafter:
        device = borrowed[0].weight.device
        drafter = load_drafter(path, dtype=torch.float32, device=str(device))
        drafter.bind(*borrowed)
        if draft_ids:
            drafter.restrict_draft_vocab(draft_ids)
        return drafter

    @property
    def block_size(self) -> int:
        return self.candidate.config.block_size

    def serve_weights_of(self, path: Path | None) -> None:
        """What serves now (None: the shipped drafter); the candidate restarts from it."""
        state = self.shipped if path is None else _copy(load_drafter(path))
        self.serving = state
        self.candidate.load_state_dict(state)
        self.optimizer.state.clear()

    def step(self, sequences: list[dict], anchors: int) -> float:
        """One optimizer step on these tapped sequences, `anchors` blocks each; its loss."""
        batch = make_batch(sequences, anchors, self.block_size, self.candidate.config.mask_token_id,
                           self.settings.gamma, self.rng)
        loss, _ = loss_and_predictions(self.candidate, self._on_device(batch))
        if self.pull:
            loss = loss + self.settings.pull * sum(
                ((param - self.shipped[name].to(param.device)) ** 2).sum()
                for name, param in self.candidate.named_parameters() if param.requires_grad)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self._params, 1.0)
        self.optimizer.step()
        return float(loss.detach())

    @torch.no_grad()
    def accepted(self, state: dict | None, sequence: dict, anchors: list[int]) -> list[int]:
        """Teacher-forced acceptance: the drafts greedy verification would accept in the block at
        each anchor, with the weights `state` (None: the candidate as it is)."""
        model = self.candidate
        if state is not None:
            self.scorer.load_state_dict(state)
            model = self.scorer
        was_training = model.training
        model.eval()
        batch = make_batch([sequence], len(anchors), self.block_size, model.config.mask_token_id,
                           self.settings.gamma, _FixedAnchors(anchors))
        _, predicted = loss_and_predictions(model, self._on_device(batch))
        model.train(was_training)
        return accepted_per_block(predicted.cpu(), batch, self.block_size).tolist()

    def save_candidate(self, directory: Path) -> None:
        """The candidate in z-lab's format, with the shipped drafter's draft vocabulary."""
        save_drafter(self.candidate, directory)
        vocab = self.shipped_path / DRAFT_VOCAB_FILE
        if vocab.is_file():
            shutil.copyfile(vocab, directory / DRAFT_VOCAB_FILE)

    def candidate_state(self) -> dict:
        return _copy(self.candidate)

    def _on_device(self, batch):
        device = self.candidate.norm.weight.device
        if device.type == "cpu":
            return batch
        return type(batch)(*(getattr(batch, name).to(device) for name in batch.__dataclass_fields__))


class _FixedAnchors:
    """make_batch's rng, answering `sample` with the anchors asked for: both sides of a
    comparison draft the very same blocks."""

    def __init__(self, anchors: list[int]):
        self.anchors = anchors

    def sample(self, candidates, count: int) -> list[int]:
        return self.anchors[:count]


def _copy(model: torch.nn.Module) -> dict:
    return {name: tensor.detach().float().cpu().clone() for name, tensor in model.state_dict().items()}
