"""Regenerate responses with the target itself (batched, cached, greedy) and keep the taps.

The taps the drafter trains on come for free from the same forward passes: forward hooks on
the tapped layers (engines.torch_engine.TapCollector). Shards are written as they finish, so a
killed run resumes where it stopped.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import DynamicCache

from dflash_local.engines.torch_engine import TapCollector


def encode_prompts(tokenizer, prompts: list[str], max_prompt_tokens: int) -> list[list[int]]:
    encoded = []
    for prompt in prompts:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) <= max_prompt_tokens:
            encoded.append(ids)
    return encoded


@torch.inference_mode()
def generate_batch(model, taps: TapCollector, prompts: list[list[int]], eos_ids: set[int],
                   max_new_tokens: int, pad_id: int) -> list[dict]:
    """Greedy, left-padded batch decoding. Returns per sequence: tokens, prompt_len, taps
    ([len(tokens) - 1, taps*H] bf16: the last token is never fed back, so it has no taps)."""
    batch, width = len(prompts), max(len(p) for p in prompts)
    pads = [width - len(p) for p in prompts]
    input_ids = torch.tensor([[pad_id] * pad + p for pad, p in zip(pads, prompts)])
    mask = torch.tensor([[0] * pad + [1] * len(p) for pad, p in zip(pads, prompts)])
    cache = DynamicCache(config=model.config)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    taps.enabled = True
    logits = model(input_ids, attention_mask=mask, position_ids=positions, cache=cache,
                   use_cache=True, logits_to_keep=1).logits
    tap_steps = [taps.take()]
    generated = []
    done = torch.zeros(batch, dtype=torch.bool)
    for _ in range(max_new_tokens):
        next_ids = logits[:, -1].argmax(-1)
        next_ids = torch.where(done, torch.full_like(next_ids, pad_id), next_ids)
        generated.append(next_ids)
        done |= torch.isin(next_ids, torch.tensor(sorted(eos_ids)))
        if bool(done.all()):
            break
        mask = torch.cat([mask, torch.ones(batch, 1, dtype=mask.dtype)], dim=1)
        positions = positions[:, -1:] + 1
        taps.enabled = True
        logits = model(next_ids[:, None], attention_mask=mask, position_ids=positions, cache=cache,
                       use_cache=True).logits
        tap_steps.append(taps.take())
    all_taps = torch.cat(tap_steps, dim=1).to(torch.bfloat16)  # [B, width + steps, taps*H]
    responses = torch.stack(generated, dim=1).tolist()
    return [_sequence(prompts[i], responses[i], all_taps[i, pads[i]:], eos_ids) for i in range(batch)]


def _sequence(prompt: list[int], response: list[int], taps: torch.Tensor, eos_ids: set[int]) -> dict:
    for index, token_id in enumerate(response):
        if token_id in eos_ids:
            response = response[: index + 1]
            break
    tokens = prompt + response
    return {"tokens": torch.tensor(tokens, dtype=torch.int32), "prompt_len": len(prompt),
            "taps": taps[: len(tokens) - 1].clone()}


def regenerate(model, tokenizer, prompts: list[str], tap_ids: tuple[int, ...], out_dir: Path,
               batch_size: int = 32, max_new_tokens: int = 128, max_prompt_tokens: int = 192,
               shard_batches: int = 2, max_minutes: float | None = None) -> Path:
    """Write shards `regen-XXXXX.pt` under out_dir; skips shards that already exist (resume)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    encoded = sorted(encode_prompts(tokenizer, prompts, max_prompt_tokens), key=len)
    batches = [encoded[i : i + batch_size] for i in range(0, len(encoded), batch_size)]
    # interleave short and long batches so an early stop still covers every length
    order = [i for pair in zip(range(len(batches)), reversed(range(len(batches)))) for i in pair]
    order = list(dict.fromkeys(order))
    shards = [order[i : i + shard_batches] for i in range(0, len(order), shard_batches)]
    taps = TapCollector(model, tap_ids)
    eos_ids = {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    eos_ids |= {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)
    start = time.perf_counter()
    produced = 0
    with tqdm(total=len(shards), desc="regenerate", unit="shard") as bar:
        for shard_index, shard in enumerate(shards):
            path = out_dir / f"regen-{shard_index:05d}.pt"
            if path.exists():
                bar.update(1)
                continue
            if max_minutes is not None and time.perf_counter() - start > max_minutes * 60:
                break
            sequences = []
            for batch_index in shard:
                sequences += generate_batch(model, taps, batches[batch_index], eos_ids,
                                            max_new_tokens, pad_id)
            produced += sum(len(s["tokens"]) - s["prompt_len"] for s in sequences)
            tmp = path.with_suffix(".tmp")
            torch.save(sequences, tmp)
            tmp.rename(path)  # a killed run never leaves a shard that looks complete
            elapsed = time.perf_counter() - start
            bar.set_postfix(tok_s=f"{produced / elapsed:.0f}")
            bar.update(1)
    return out_dir
