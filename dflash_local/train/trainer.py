"""Train a DFlash drafter on regenerated data (the published recipe, DFLASH.md "Training").

Target embeddings and LM head are frozen and shared; cross-entropy on block positions
1..B-1 weighted exp(-(k-1)/gamma); AdamW, cosine schedule with warmup, grad clip; resumable
checkpoints; the output directory is the exact z-lab format.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from dflash_local.drafter.config import DFlash2Config, DrafterConfig
from dflash_local.drafter.model_torch import DFlashDrafter, save_drafter
from dflash_local.errors import DFlashError
from dflash_local.train.batches import Batch, make_batch


@dataclass(frozen=True)
class TrainSettings:
    block_size: int = 16
    gamma: float = 7.0
    anchors_per_seq: int = 16
    seqs_per_step: int = 4
    lr: float = 6e-4
    warmup_frac: float = 0.04
    grad_clip: float = 1.0
    steps: int | None = None  # None: fit the schedule to train_minutes
    train_minutes: float = 40.0
    checkpoint_every: int = 100
    seed: int = 0
    bf16: bool = False  # autocast the drafter's matmuls (and the shared head) to bfloat16


def load_sequences(data_dir: Path) -> list[dict]:
    shards = sorted(data_dir.glob("regen-*.pt"))
    if not shards:
        raise DFlashError(f"no regenerated data (regen-*.pt) in {data_dir}: run the regenerate step first")
    # mapped, not read: the taps outgrow memory (~20 GB for the embedded drafter's data), and a
    # training step reads only the few sequences it samples
    sequences = [s for shard in shards for s in torch.load(shard, weights_only=True, mmap=True)]
    return [s for s in sequences if len(s["tokens"]) - s["prompt_len"] >= 2]


def split_validation(sequences: list[dict], fraction: float = 0.02, minimum: int = 8):
    """(validation, training): the sequences whose prompts hash lowest. Spread over every kind
    of prompt (the first shards are not: they hold the shortest and the longest prompts), and
    mostly the same slice when more data is added."""
    def prompt_hash(sequence: dict) -> bytes:
        return hashlib.sha256(sequence["tokens"][: sequence["prompt_len"]].numpy().tobytes()).digest()

    ranked = sorted(range(len(sequences)), key=lambda i: prompt_hash(sequences[i]))
    chosen = set(ranked[: max(minimum, round(len(sequences) * fraction))])
    return ([s for i, s in enumerate(sequences) if i in chosen],
            [s for i, s in enumerate(sequences) if i not in chosen])


def init_from_target(drafter: DFlashDrafter, target) -> None:
    """Start the draft layers from the target's last layers and the target's final norm: the
    drafter's output feeds the target's LM head, so matching its scale shortens training."""
    from dflash_local.engines.torch_engine import decoder_layers

    source_layers = decoder_layers(target)[-len(drafter.layers):]
    with torch.no_grad():
        for draft_layer, source in zip(drafter.layers, source_layers):
            own = draft_layer.state_dict()
            for name, tensor in source.state_dict().items():
                if name in own and own[name].shape == tensor.shape:
                    own[name].copy_(tensor)
        drafter.norm.weight.copy_(target.model.norm.weight)


def batch_loss(drafter: DFlashDrafter, batch: Batch) -> tuple[torch.Tensor, dict]:
    """Weighted cross-entropy over the drafter's draft vocabulary (the whole one if it has none:
    a restricted head is ~6x cheaper here too, and a label outside the set cannot be proposed,
    so it carries no loss, but it still counts as a miss in the metrics)."""
    loss, predicted = loss_and_predictions(drafter, batch)
    return loss, _metrics(predicted, batch, drafter.config.block_size)


def loss_and_predictions(drafter: DFlashDrafter, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """batch_loss's loss, and the token the drafter (DFlash 2: its selector) drafts at each
    block position, [b, Q]."""
    hidden = drafter.forward_packed(batch.block_ids, batch.taps, batch.block_pos, batch.mask)
    logits, draft_ids = drafter.draft_logits(hidden)
    logits = logits.float()  # [b, Q, V or K]
    labels = batch.labels if draft_ids is None else _draft_indices(batch.labels, draft_ids, drafter.config.vocab_size)
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="none")
    weights = batch.weights.flatten()
    loss = (ce * weights).sum() / weights.sum().clamp(min=1e-6)
    predicted = logits.detach().argmax(-1)
    if draft_ids is not None:
        predicted = draft_ids[predicted]
    if drafter.candidate_selector is not None:
        selector_loss, predicted = _selector_terms(drafter.candidate_selector, hidden, logits, draft_ids,
                                                   labels, batch)
        loss = loss + selector_loss
    return loss, predicted


def _selector_terms(selector, hidden, logits, draft_ids, labels, batch: Batch):
    """DFlash 2's selector, trained as it drafts but teacher-forced: at each block position a
    choice among the drafter's top-K (the gold token always among them), after the gold token
    before it; cross-entropy on the gold's index, weighted as the drafter's loss. The row
    before a block's first draft is its anchor, whose label is the anchor token itself.
    Returns (that loss, the selector's unforced picks: what the metrics count)."""
    previous = torch.cat([batch.labels[:, :1], batch.labels[:, :-1]], dim=1).clamp(min=0)
    scores, _, gold_index = selector.training_scores(hidden, logits, draft_ids, labels, previous)
    weights = batch.weights * (labels != -100)  # a gold outside the draft vocabulary: no choice
    ce = F.cross_entropy(scores.float().flatten(0, 1), gold_index.flatten(), reduction="none")
    with torch.no_grad():
        free, ids, _ = selector.training_scores(hidden, logits, draft_ids, labels, previous, force_gold=False)
        picks = ids.gather(-1, free.argmax(-1, keepdim=True))[..., 0]
    return (ce * weights.flatten()).sum() / weights.sum().clamp(min=1e-6), picks


def dflash2_sizes(hidden_size: int) -> DFlash2Config:
    """DFlash 2's sizes for a new drafter: a 4-tap convolution whose channel groups are 64 wide
    (or the widest divisor of the hidden size under that), a rank-32 selector over 8 candidates."""
    group = max(size for size in range(1, 65) if hidden_size % size == 0)
    return DFlash2Config(conv_kernel_size=4, conv_group_size=group, selector_rank=32, selector_top_k=8)


def start_dflash2_parts(drafter: DFlashDrafter, seed: int = 0) -> None:
    """DFlash 2's own parts as a v1 drafter's equal: convolutions that pass rows through, a
    near-neutral selector (the drafter's logits choose); training then makes them matter."""
    for layer in drafter.layers:
        layer.attention_conv.become_identity()
        layer.mlp_conv.become_identity()
    drafter.candidate_selector.start_neutral(torch.Generator().manual_seed(seed))


def _draft_indices(labels: torch.Tensor, draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Token ids -> positions in the draft vocabulary; -100 where absent (or already -100)."""
    table = torch.full((vocab_size,), -100, dtype=torch.long, device=labels.device)
    table[draft_ids] = torch.arange(len(draft_ids), device=labels.device)
    return torch.where(labels == -100, labels, table[labels.clamp(min=0)])


def _metrics(predicted: torch.Tensor, batch: Batch, block_size: int) -> dict:
    """Accuracy at position 1 and the τ greedy verification would give on these blocks."""
    correct, valid = _block_hits(predicted, batch, block_size)
    has_block = valid[..., 0]
    return {
        "acc1": float(correct[..., 0][has_block].float().mean()),
        "tau": float(1 + accepted_per_block(predicted, batch, block_size).float().mean()),
    }


def _block_hits(predicted: torch.Tensor, batch: Batch, block_size: int):
    """([b, blocks, B-1] draft equals the target's token, [b, blocks, B-1] a label is there)."""
    correct = (predicted == batch.labels).view(predicted.shape[0], -1, block_size)[..., 1:]
    valid = (batch.labels != -100).view(correct.shape[0], -1, block_size)[..., 1:]
    return correct, valid


def accepted_per_block(predicted: torch.Tensor, batch: Batch, block_size: int) -> torch.Tensor:
    """[blocks]: the drafts greedy verification would accept in each block that has one (its
    leading run of hits); τ is 1 + their mean."""
    correct, valid = _block_hits(predicted, batch, block_size)
    leading = (correct & valid).int().cumprod(-1).sum(-1)
    return leading[valid[..., 0]]


# while a time-budgeted run measures its pace (StepBudget) its length is unknown: warm up as if
# it were this long, more steps than any run here takes, so the ramp only steepens once the real
# length is known (a short provisional length would peak early, then drop back into warm-up)
PROVISIONAL_TOTAL = 100_000


def lr_at(step: int, total: int | None, settings: TrainSettings) -> float:
    total = total or PROVISIONAL_TOTAL
    warmup = max(1, int(total * settings.warmup_frac))
    if step < warmup:
        return settings.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return settings.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


class StepBudget:
    """Fits the cosine schedule's length to a time budget. The pace is measured over steps 6..25
    of the run, not from its start: the first steps run slower (allocators, oneDNN kernels), and
    fitting on them ended a 45-minute run after 28 minutes."""

    SKIP, MEASURE = 5, 20

    def __init__(self, minutes: float, clock=time.perf_counter):
        self.budget_s, self.clock = minutes * 60, clock
        self.started = clock()
        self._steps = 0
        self._mark: float | None = None  # when step SKIP ended

    def total_after_step(self, step: int) -> int | None:
        """Call after every step while the total is unknown: the fitted total once measured."""
        self._steps += 1
        now = self.clock()
        if self._steps == self.SKIP:
            self._mark = now
        if self._steps < self.SKIP + self.MEASURE:
            return None
        per_step = (now - self._mark) / self.MEASURE
        return max(step + 1, step + int((self.budget_s - (now - self.started)) / per_step))


def checkpoint_path_for(out_dir: Path) -> Path:
    """Beside the output directory, which stays a clean z-lab checkpoint."""
    return out_dir.parent / f"{out_dir.name}.checkpoint.pt"


def train(drafter: DFlashDrafter, sequences: list[dict], out_dir: Path, settings: TrainSettings) -> dict:
    """Runs (or resumes) training; writes out_dir (z-lab format) and out_dir/../checkpoint.pt."""
    checkpoint_path = checkpoint_path_for(out_dir)
    rng = random.Random(settings.seed)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
    state = {"step": 0, "total": settings.steps, "history": []}
    if checkpoint_path.exists():
        saved = torch.load(checkpoint_path, weights_only=False)
        drafter.load_state_dict(saved["drafter"])
        optimizer.load_state_dict(saved["optimizer"])
        state = saved["state"]
        rng.setstate(saved["rng"])
    held_out, train_set = split_validation(sequences)
    budget = StepBudget(settings.train_minutes)
    bar = tqdm(initial=state["step"], total=state["total"], desc="train", unit="step")
    while state["total"] is None or state["step"] < state["total"]:
        batch = make_batch(rng.sample(train_set, settings.seqs_per_step), settings.anchors_per_seq,
                           settings.block_size, drafter.config.mask_token_id, settings.gamma, rng)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(state["step"], state["total"], settings)
        with torch.autocast(next(drafter.parameters()).device.type, dtype=torch.bfloat16, enabled=settings.bf16):
            loss, metrics = batch_loss(drafter, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
        optimizer.step()
        state["step"] += 1
        if state["total"] is None:
            state["total"] = budget.total_after_step(state["step"])
            bar.total = state["total"]
        loss_value = float(loss.detach())
        state["history"].append({"step": state["step"], "loss": loss_value, **metrics})
        bar.set_postfix(loss=f"{loss_value:.3f}", tau=f"{metrics['tau']:.2f}")
        bar.update(1)
        if state["step"] % settings.checkpoint_every == 0:
            _checkpoint(drafter, optimizer, state, rng, checkpoint_path, out_dir)
    bar.close()
    _checkpoint(drafter, optimizer, state, rng, checkpoint_path, out_dir)
    return {"steps": state["step"], "held_out": evaluate(drafter, held_out, settings),
            "settings": asdict(settings), "history_tail": state["history"][-20:]}


@torch.no_grad()
def evaluate(drafter: DFlashDrafter, sequences: list[dict], settings: TrainSettings) -> dict:
    rng = random.Random(1234)
    totals = {"loss": 0.0, "acc1": 0.0, "tau": 0.0}
    for start in range(0, len(sequences), settings.seqs_per_step):
        batch = make_batch(sequences[start : start + settings.seqs_per_step], settings.anchors_per_seq,
                           settings.block_size, drafter.config.mask_token_id, settings.gamma, rng)
        loss, metrics = batch_loss(drafter, batch)
        for key, value in {"loss": float(loss), **metrics}.items():
            totals[key] += value
    batches = math.ceil(len(sequences) / settings.seqs_per_step)
    return {key: value / batches for key, value in totals.items()}


def _checkpoint(drafter, optimizer, state, rng, checkpoint_path: Path, out_dir: Path) -> None:
    tmp = checkpoint_path.with_suffix(".tmp")
    torch.save({"drafter": drafter.state_dict(), "optimizer": optimizer.state_dict(),
                "state": state, "rng": rng.getstate()}, tmp)
    tmp.rename(checkpoint_path)  # atomic: a kill mid-save keeps the previous checkpoint
    save_drafter(drafter, out_dir)


def drafter_config_for(target_config, layers: int, block_size: int, taps: tuple[int, ...],
                       mask_token_id: int, dflash2: DFlash2Config | None = None) -> DrafterConfig:
    """A drafter shaped like the target's own layers (so it can start from them); `dflash2`:
    DFlash 2's sizes (None: a v1 drafter)."""
    text = getattr(target_config, "text_config", None) or target_config
    rope = getattr(text, "rope_parameters", None) or {}
    heads = text.num_attention_heads
    return DrafterConfig(
        version="dflash2" if dflash2 else "dflash", hidden_size=text.hidden_size, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=text.num_key_value_heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        intermediate_size=text.intermediate_size, vocab_size=text.vocab_size,
        rms_norm_eps=text.rms_norm_eps, max_position_embeddings=text.max_position_embeddings,
        block_size=block_size, target_layer_ids=taps, mask_token_id=mask_token_id,
        rope_theta=float(rope.get("rope_theta", getattr(text, "rope_theta", 10000.0))),
        num_target_layers=text.num_hidden_layers, dflash2=dflash2,
    )
