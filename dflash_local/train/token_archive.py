"""Regenerated data without its taps: a few MB that can travel with the repo or to another machine.

Regeneration is the recipe's dearest step (the target decodes every response token by token, ~200
tokens/s on a 2-core CPU); the taps are not: one teacher-forced forward over each finished sequence
gives them again. `save_tokens` keeps a data directory's sequences (token ids and prompt lengths),
`retap` writes such an archive back as shards that `train` reads, skipping prompts the directory
already holds (so a later regeneration into it only adds what the archive lacks).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
import zipfile
import zlib
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from dflash_local.drafter.config import TargetInfo
from dflash_local.engines.torch_engine import TapCollector
from dflash_local.errors import CheckpointError
from dflash_local.train.regenerate import done_prompts, prompt_key, record_data_taps, write_shard

FORMAT = 1


def tokenizer_fingerprint(tokenizer) -> str:
    """Which tokenizer the ids belong to: the same vocabulary gives the same string."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def target_fingerprint(target: TargetInfo) -> str:
    """Which target produced the responses: targets sharing a tokenizer (SmolLM2 135M, 360M,
    1.7B) answer differently, and a drafter learns the answers of the one it drafts for."""
    return f"{target.model_type}/{target.num_hidden_layers}x{target.hidden_size}/vocab {target.vocab_size}"


def save_tokens(sequences: list[dict], path: Path, tokenizer, target: str) -> Path:
    """Write the sequences' token ids and prompt lengths (compressed npz, atomically).
    `target`: target_fingerprint of the model that regenerated them."""
    if not sequences:
        raise CheckpointError("no regenerated sequences to save")
    tokens = np.concatenate([s["tokens"].numpy() for s in sequences])
    dtype = np.uint16 if int(tokens.max()) < 2**16 else np.uint32
    path = Path(path)
    # numpy appends ".npz" to a name without it: the partial name must end so to be the file written
    partial = path.with_name(f"{path.stem}.partial{os.getpid()}.npz")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(
            partial, format=np.int64(FORMAT), tokenizer=np.array(tokenizer_fingerprint(tokenizer)),
            target=np.array(target), tokens=tokens.astype(dtype),
            lengths=np.array([len(s["tokens"]) for s in sequences], dtype=np.int64),
            prompt_lens=np.array([s["prompt_len"] for s in sequences], dtype=np.int64))
        os.replace(partial, path)  # a full disk or a kill never leaves a half archive
    except OSError as exc:  # the data directory is untouched: rerun with --regen-minutes 0
        raise CheckpointError(f"could not write the token archive {path} ({exc})") from None
    finally:
        with contextlib.suppress(OSError):  # nothing to remove where nothing could be written
            partial.unlink(missing_ok=True)
    return path


FIELDS = ("format", "tokenizer", "target", "tokens", "lengths", "prompt_lens")


def load_tokens(path: Path, tokenizer, target: str) -> list[dict]:
    """The archive's sequences ({"tokens", "prompt_len"}); a clear error for an archive of
    another tokenizer or target, or a damaged one."""
    fields = _read_fields(path)
    if int(fields["format"]) != FORMAT:
        raise CheckpointError(f"{path} is token-archive format {int(fields['format'])}; this version reads {FORMAT}")
    ours = tokenizer_fingerprint(tokenizer)
    if str(fields["tokenizer"]) != ours:
        raise CheckpointError(f"{path} holds ids of another tokenizer (fingerprint {fields['tokenizer']}) "
                              f"than this target's ({ours}): its sequences cannot train a drafter for it")
    if str(fields["target"]) != target:
        raise CheckpointError(f"{path} holds the responses of another target ({fields['target']}) than "
                              f"this one ({target}): a drafter must learn its own target's answers")
    tokens, lengths, prompt_lens = fields["tokens"], fields["lengths"], fields["prompt_lens"]
    if lengths.ndim != 1 or lengths.shape != prompt_lens.shape:
        raise CheckpointError(f"{path} is damaged: {lengths.size} lengths for {prompt_lens.size} prompt lengths")
    if int(lengths.sum()) != len(tokens):
        raise CheckpointError(f"{path} is damaged: its lengths add up to {int(lengths.sum())} tokens, "
                              f"it holds {len(tokens)}")
    if bool((prompt_lens >= lengths).any()) or bool((prompt_lens < 1).any()):
        bad = int(np.flatnonzero((prompt_lens >= lengths) | (prompt_lens < 1))[0])
        raise CheckpointError(f"{path} is damaged: sequence {bad} has a prompt of {int(prompt_lens[bad])} "
                              f"tokens in {int(lengths[bad])}")
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    ids = torch.from_numpy(tokens.astype(np.int32))
    return [{"tokens": ids[start : start + length].clone(), "prompt_len": int(prompt_len)}
            for start, length, prompt_len in zip(starts, lengths, prompt_lens)]


def _read_fields(path: Path) -> dict[str, np.ndarray]:
    unreadable = (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error)
    try:
        archive = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise CheckpointError(f"no token archive at {path}") from None
    except unreadable as exc:
        raise CheckpointError(f"{path} is not a readable token archive ({exc})") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):  # a bare .npy array
        raise CheckpointError(f"{path} is not a readable token archive (one array, not an .npz)")
    try:
        with archive:
            return {name: archive[name] for name in FIELDS}
    except unreadable as exc:
        raise CheckpointError(f"{path} is not a readable token archive ({exc})") from None


@torch.inference_mode()
def retap(model, sequences: list[dict], tap_ids: tuple[int, ...], out_dir: Path,
          batch_size: int = 16, shard_size: int = 64) -> int:
    """Shards of these sequences with their taps, as regeneration writes them; returns how many
    sequences were added. Right padding needs no attention mask: a causal row never sees the
    pads after it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    record_data_taps(out_dir, tap_ids, model.config.get_text_config().hidden_size)
    done, next_index = done_prompts(out_dir)
    todo = sorted((s for s in sequences if prompt_key(s) not in done), key=lambda s: len(s["tokens"]))
    taps = TapCollector(model, tap_ids)
    device = next(model.parameters()).device
    start, written, tokens_done = time.perf_counter(), 0, 0
    try:
        with tqdm(total=len(todo), desc="retap", unit="seq") as bar:
            for shard_start in range(0, len(todo), shard_size):
                shard = todo[shard_start : shard_start + shard_size]
                out = []
                for batch_start in range(0, len(shard), batch_size):
                    batch = shard[batch_start : batch_start + batch_size]
                    out += _retap_batch(model, taps, batch, device)
                    bar.update(len(batch))
                write_shard(out_dir / f"regen-{next_index:05d}.pt", out)
                next_index += 1
                written += len(out)
                tokens_done += sum(len(s["tokens"]) for s in out)
                bar.set_postfix(tok_s=f"{tokens_done / (time.perf_counter() - start):.0f}")
    finally:
        taps.remove()
    return written


def _retap_batch(model, taps: TapCollector, batch: list[dict], device) -> list[dict]:
    # the last token is never fed back (regeneration's shards have no taps for it either)
    rows = [s["tokens"][:-1].long() for s in batch]
    width = max(len(r) for r in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = row
    taps.enabled = True
    model(input_ids.to(device), use_cache=False, logits_to_keep=1)
    collected = taps.take().to(torch.bfloat16).cpu()
    return [{"tokens": s["tokens"].to(torch.int32), "prompt_len": s["prompt_len"],
             "taps": collected[i, : len(rows[i])].clone()} for i, s in enumerate(batch)]
