"""Regenerate responses with the target itself (batched, cached, greedy) and keep the taps.

The taps the drafter trains on come for free from the same forward passes: forward hooks on
the tapped layers (engines.torch_engine.TapCollector). Shards are written as they finish, so a
killed run resumes where it stopped.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import StaticCache

from dflash_local.engines.chat_prompt import chat_prompt_ids, end_of_turn_ids, eos_id_list
from dflash_local.engines.detokenize import speaks_harmony
from dflash_local.engines.torch_engine import TapCollector
from dflash_local.errors import DFlashError
from dflash_local.service.harmony import split_reply
from dflash_local.train.chat_prompts import follow_up_conversations, templated_chat_prompts

DATA_INFO = "regen.json"  # which target layers the taps of this directory's shards come from
MAX_PROMPT_TOKENS = 192  # longer prompts (chat template included) are skipped, not truncated


Prompt = str | list[dict]  # one user request, or a conversation ending on the user's turn


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """The ids the target sees for a prompt, as the engines encode a chat."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return chat_prompt_ids(tokenizer, messages)


def encode_prompts(tokenizer, prompts: list[Prompt],
                   max_prompt_tokens: int | None = MAX_PROMPT_TOKENS) -> list[list[int]]:
    """None: no limit (a conversation whose turns were each held to one already)."""
    encoded = (encode_prompt(tokenizer, prompt) for prompt in prompts)
    return [ids for ids in encoded if max_prompt_tokens is None or len(ids) <= max_prompt_tokens]


@torch.inference_mode()
def generate_batch(model, taps: TapCollector, prompts: list[list[int]], eos_ids: set[int],
                   max_new_tokens: int, pad_id: int) -> list[dict]:
    """Greedy, left-padded batch decoding. Returns per sequence: tokens, prompt_len, taps
    ([len(tokens) - 1, taps*H] bf16: the last token is never fed back, so it has no taps)."""
    batch, width = len(prompts), max(len(p) for p in prompts)
    pads = [width - len(p) for p in prompts]
    input_ids = torch.tensor([[pad_id] * pad + p for pad, p in zip(pads, prompts)])
    mask = torch.tensor([[0] * pad + [1] * len(p) for pad, p in zip(pads, prompts)])
    # preallocated: a growing cache spent more time concatenating than the model computing
    cache = StaticCache(config=model.config, max_cache_len=width + max_new_tokens)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    taps.enabled = True
    logits = model(input_ids, attention_mask=mask, position_ids=positions, cache=cache,
                   cache_position=torch.arange(width), use_cache=True, logits_to_keep=1).logits
    tap_steps = [taps.take()]
    generated = []
    done = torch.zeros(batch, dtype=torch.bool)
    for step in range(max_new_tokens):
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
                       cache_position=torch.tensor([width + step]), use_cache=True).logits
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


def regenerate(model, tokenizer, prompts: list[Prompt], tap_ids: tuple[int, ...], out_dir: Path,
               batch_size: int = 32, max_new_tokens: int = 128,
               max_prompt_tokens: int | None = MAX_PROMPT_TOKENS,
               shard_batches: int = 2, max_minutes: float | None = None) -> Path:
    """Write shards `regen-XXXXX.pt` under out_dir. Prompts already in a shard there are skipped,
    so a killed run resumes, and a longer prompt list adds to the same directory."""
    generation = getattr(model, "generation_config", None)  # the target's own stop ids
    eos_ids = set(end_of_turn_ids(tokenizer, eos_id_list(getattr(generation, "eos_token_id", None))))
    if not eos_ids:  # before anything is written or hooked
        raise DFlashError("the target's tokenizer names no end-of-turn token: a regenerated "
                          "response would never end")
    out_dir.mkdir(parents=True, exist_ok=True)
    record_data_taps(out_dir, tap_ids, model.config.get_text_config().hidden_size)
    done, next_index = done_prompts(out_dir)
    encoded = sorted((p for p in encode_prompts(tokenizer, prompts, max_prompt_tokens) if tuple(p) not in done), key=len)
    batches = [encoded[i : i + batch_size] for i in range(0, len(encoded), batch_size)]
    # interleave short and long batches so an early stop still covers every length
    order = [i for pair in zip(range(len(batches)), reversed(range(len(batches)))) for i in pair]
    order = list(dict.fromkeys(order))
    shards = [order[i : i + shard_batches] for i in range(0, len(order), shard_batches)]
    taps = TapCollector(model, tap_ids)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)
    start = time.perf_counter()
    produced = 0
    try:
        with tqdm(total=len(shards), desc="regenerate", unit="shard") as bar:
            for shard_number, shard in enumerate(shards):
                if max_minutes is not None and time.perf_counter() - start > max_minutes * 60:
                    break
                sequences = []
                for batch_index in shard:
                    sequences += generate_batch(model, taps, batches[batch_index], eos_ids,
                                                max_new_tokens, pad_id)
                produced += sum(len(s["tokens"]) - s["prompt_len"] for s in sequences)
                write_shard(out_dir / f"regen-{next_index + shard_number:05d}.pt", sequences)
                elapsed = time.perf_counter() - start
                bar.set_postfix(tok_s=f"{produced / elapsed:.0f}")
                bar.update(1)
    finally:
        taps.remove()  # the model outlives this run (a --bf16-less run trains with it next)
    return out_dir


def record_data_taps(data_dir: Path, tap_ids, hidden_size: int) -> None:
    """Say in a new data directory which target layers its taps come from, and refuse to add
    shards of other layers: training on them would be silently wrong. Shards from before the
    record existed get none (their layers are unknown; training checks their width)."""
    path = data_dir / DATA_INFO
    if path.exists():
        check_data_taps(data_dir, tap_ids, hidden_size)
    elif not any(data_dir.glob("regen-*.pt")):
        _atomic_write(path, json.dumps({"taps": list(tap_ids), "hidden_size": hidden_size}).encode())


def check_data_taps(data_dir: Path, tap_ids, hidden_size: int) -> None:
    """A clear error when the data directory records taps of other layers than these."""
    path = data_dir / DATA_INFO
    if not path.exists():  # data from before the record existed: the shape check still runs
        return
    recorded = json.loads(path.read_text())
    if recorded.get("taps") != list(tap_ids) or recorded.get("hidden_size") != hidden_size:
        raise DFlashError(
            f"{data_dir} holds taps of target layers {recorded.get('taps')} (hidden size "
            f"{recorded.get('hidden_size')}); this run uses layers {list(tap_ids)} (hidden size "
            f"{hidden_size}): pass --taps to match, or another --data directory")


def write_shard(path: Path, sequences: list[dict]) -> None:
    # training maps shards (trainer.load_sequences): replace one by rename, never rewrite in place
    # the prompt index first: a shard without one is indexed on the next start, never lost
    _atomic_write(_index_path(path), json.dumps(_prompt_ids(sequences)).encode())
    tmp = path.with_suffix(".tmp")
    torch.save(sequences, tmp)
    tmp.rename(path)  # a killed run never leaves a shard that looks complete


def done_prompts(out_dir: Path) -> tuple[set[tuple[int, ...]], int]:
    """The prompts (token ids) the shards in out_dir hold, and the next free shard number."""
    done, next_index = set(), 0
    for shard in sorted(out_dir.glob("regen-*.pt")):
        done.update(tuple(p) for p in _shard_prompts(shard))
        next_index = max(next_index, int(shard.stem.split("-")[1]) + 1)
    return done, next_index


def _shard_prompts(shard: Path) -> list[list[int]]:
    """A shard's prompt ids, from its index; shards from before the index existed are read once
    and indexed for next time."""
    index = _index_path(shard)
    if index.exists():
        return json.loads(index.read_text())
    prompts = _prompt_ids(torch.load(shard, weights_only=True, mmap=True))
    _atomic_write(index, json.dumps(prompts).encode())
    return prompts


def answers_in(out_dir: Path, prompts: set[tuple[int, ...]]) -> dict[tuple[int, ...], list[int]]:
    """The response ids (an end-of-turn id last where the answer finished) that out_dir's shards
    hold for these prompts. Only shards whose index names one of them are opened (mapped: their
    taps are never read)."""
    answers = {}
    for shard in sorted(out_dir.glob("regen-*.pt")):
        if prompts.isdisjoint(map(tuple, _shard_prompts(shard))):
            continue
        for sequence in torch.load(shard, weights_only=True, mmap=True):
            if (key := prompt_key(sequence)) in prompts:
                answers[key] = sequence["tokens"][sequence["prompt_len"]:].tolist()
    return answers


def follow_up_prompts(tokenizer, data_dir: Path) -> list[list[dict]]:
    """chat_prompts.follow_up_conversations() for the templated chat requests that data_dir holds
    answers to. An answer goes back as a chat client sends it (answer_text), and as the target
    wrote it: cut at the first run's --max-new-tokens where it ran longer (a user asking on after
    a cut answer is a conversation too; one cut before any answer, inside a harmony target's
    reasoning, is not)."""
    requests = {tuple(encode_prompt(tokenizer, request)): request
                for request in templated_chat_prompts()}
    answers = {requests[key]: answer_text(tokenizer, ids)
               for key, ids in answers_in(data_dir, set(requests)).items()}
    conversations = follow_up_conversations(answers)
    if not conversations:
        raise DFlashError(f"--chat-followups: {data_dir} holds no answers to the --chat-prompts "
                          "requests; regenerate those into it first (--chat-prompts)")
    return conversations


def answer_text(tokenizer, response_ids: list[int]) -> str:
    """A response as a chat client keeps it to send back: a harmony target's (gpt-oss) content
    as the service splits it, without the analysis channel and the format's markers (decoded
    without special tokens, those would glue "analysis...assistantfinal..." into one text);
    any other target's text without special tokens."""
    if speaks_harmony(tokenizer):
        return split_reply(tokenizer.decode(response_ids, skip_special_tokens=False))[0].strip()
    return tokenizer.decode(response_ids, skip_special_tokens=True).strip()


def prompt_key(sequence: dict) -> tuple[int, ...]:
    """A sequence's prompt ids: what says two sequences answer the same prompt."""
    return tuple(sequence["tokens"][: sequence["prompt_len"]].tolist())


def _prompt_ids(sequences: list[dict]) -> list[list[int]]:
    return [list(prompt_key(s)) for s in sequences]


def _index_path(shard: Path) -> Path:
    return shard.with_name(shard.stem + ".prompts.json")


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.rename(path)
