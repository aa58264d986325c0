"""An autoregressive draft model for a target: the peer DFlash is measured against.

Same data as the DFlash recipe (the target's own regenerated responses), same tokenizer, about the
same trainable size (a few of the target's layers, embeddings and LM head copied and frozen), so
`dflash-local bench --peers --ar-draft DIR` compares drafting methods rather than data or scale.
The output is a plain Transformers model directory that `assistant_model` and mlx-lm's
draft-model generation both load.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from dflash_local.train.trainer import StepBudget, TrainSettings, lr_at, split_validation


def ar_draft_from_target(target, layers: int):
    """A `layers`-deep copy of the target's architecture: its first and last layers (the ones
    next to the embeddings and the head), the shared tables frozen."""
    from transformers import AutoModelForCausalLM

    config = target.config.__class__.from_dict(target.config.to_dict())
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    source = target.model.layers
    picked = [0, *range(len(source) - layers + 1, len(source))][:layers]
    with torch.no_grad():
        for own, index in zip(draft.model.layers, picked):
            own.load_state_dict(source[index].state_dict())
        draft.model.norm.load_state_dict(target.model.norm.state_dict())
        draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        if not config.tie_word_embeddings:
            draft.lm_head.weight.copy_(target.lm_head.weight)
    draft.model.embed_tokens.weight.requires_grad_(False)
    draft.lm_head.weight.requires_grad_(False)
    return draft


def response_batch(sequences: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and next-token labels; loss only where the target was answering."""
    length = max(len(s["tokens"]) for s in sequences)
    ids = torch.zeros(len(sequences), length, dtype=torch.long)
    labels = torch.full((len(sequences), length), -100, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        tokens = sequence["tokens"].long()
        ids[row, : len(tokens)] = tokens
        start = max(sequence["prompt_len"] - 1, 0)  # predicts the first response token onwards
        labels[row, start : len(tokens) - 1] = tokens[start + 1 :]
    return ids, labels


def ar_loss(draft, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, float]:
    hidden = draft.model(input_ids=ids).last_hidden_state
    keep = labels != -100
    logits = draft.lm_head(hidden[keep]).float()  # only answered rows reach the 49k-wide head
    loss = F.cross_entropy(logits, labels[keep])
    return loss, float((logits.argmax(-1) == labels[keep]).float().mean())


def train_ar_draft(draft, sequences: list[dict], out_dir: Path, settings: TrainSettings,
                   batch_seqs: int = 8) -> dict:
    rng = random.Random(settings.seed)
    held_out, train_set = split_validation(sequences)  # the same split as the DFlash trainer
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
    draft.train()
    step, total, budget = 0, settings.steps, StepBudget(settings.train_minutes)
    bar = tqdm(total=total, desc="train-ar", unit="step")
    while total is None or step < total:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, total, settings)
        ids, labels = response_batch(rng.sample(train_set, batch_seqs))
        with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=settings.bf16):
            loss, acc = ar_loss(draft, ids, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
        optimizer.step()
        step += 1
        if total is None:
            total = bar.total = budget.total_after_step(step)
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}", acc=f"{acc:.2f}")
        bar.update(1)
    bar.close()
    draft.eval()
    with torch.no_grad():
        held = [ar_loss(draft, *response_batch(held_out[i : i + batch_seqs]))
                for i in range(0, len(held_out), batch_seqs)]
    out_dir.mkdir(parents=True, exist_ok=True)
    draft.save_pretrained(out_dir)
    return {"steps": step, "held_out": {"loss": sum(float(l) for l, _ in held) / len(held),
                                        "next_token_acc": sum(a for _, a in held) / len(held)},
            "trainable_parameters": sum(p.numel() for p in params)}
