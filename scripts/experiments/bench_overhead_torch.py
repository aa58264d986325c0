"""Overhead of our loop: plain decoding through TorchEngine.stream (no drafter, block size 1) vs
transformers' own `model.generate()` (greedy) on the same model, prompt and token count.

The bar is >= 0.9x generate()'s tokens/s. Both sides are timed end to end (prefill + N new
tokens, N forced: min_new_tokens there, an unused stop id here), in wall and in CPU time; runs
alternate between the two (this machine is shared) and the median of each is reported.

    .venv/bin/python scripts/experiments/bench_overhead_torch.py [--tokens 128] [--runs 5] [--target DIR]
                                                     [--threads 1]

Default target: the embedded SmolLM2-135M when DFLASH_EMBEDDED_TARGET names an imported
directory, else a random 42M-parameter Llama (vocab 32000) built from a config.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from dflash_local.accel.torch_linear import PackedLinear
from dflash_local.engines.torch_engine import TorchEngine
from dflash_local.events import GenerationParams, GenerationStats

BAR = 0.9
PROMPT = "def fibonacci(n):\n    " * 8


def write_random_llama(out: Path, vocab: int = 32000) -> Path:
    """~42M params: 8 layers, width 512, GQA 8/4, tied embeddings; a byte-level tokenizer whose
    vocab is padded to the model's so every id decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    config = LlamaConfig(vocab_size=vocab, hidden_size=512, intermediate_size=1408,
                         num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=2048, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    specials = ["<pad>", "<s>", "</s>"]
    tokens = specials + sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens += [f"t{index}" for index in range(vocab - len(tokens))]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(out)
    return out


class Timer:
    """Wall and CPU (process) time of a block. With one torch thread, CPU time is the work done,
    whatever else the shared machine runs; wall time is what a user waits."""

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def ours_run(engine: TorchEngine, prompt_ids: list[int], tokens: int) -> Timer:
    """Our loop with block size 1, through the engine's stream (detokenization included)."""
    params = GenerationParams(max_tokens=tokens, speculative=False, stop_token_ids=(-1,))
    stats = GenerationStats()
    with Timer() as timer:
        for event in engine.stream(prompt_ids, params):
            stats.add(event)
    assert stats.completion_tokens == tokens
    return timer


def generate_run(model, prompt_ids: list[int], tokens: int) -> Timer:
    input_ids = torch.tensor([prompt_ids])
    with Timer() as timer, torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=0)
    assert out.shape[1] - input_ids.shape[1] == tokens
    return timer


def default_target(tmp: Path) -> Path:
    embedded = os.environ.get("DFLASH_EMBEDDED_TARGET")
    if embedded and (Path(embedded) / "config.json").is_file():
        return Path(embedded)
    return write_random_llama(tmp / "llama-42m")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--target", type=Path, help="a transformers model directory")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a busy 2-core machine, 2 threads "
                             "wait on each other and the timings become noise)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        target = args.target or default_target(Path(tmp))
        engine = TorchEngine(target, None)
    packed = [m for m in engine.model.modules() if isinstance(m, PackedLinear) and not hasattr(m, "weight")]
    params = (sum(p.numel() for p in engine.model.parameters())
              + sum(m.in_features * m.out_features for m in packed)) / 1e6  # packed: no Parameter
    prompt_ids = engine.encode_raw(PROMPT)
    print(f"target {target} ({params:.0f}M params), prompt {len(prompt_ids)} tokens, "
          f"{args.tokens} new tokens, torch threads {torch.get_num_threads()}")
    ours_run(engine, prompt_ids, 8)  # warm-up both paths
    generate_run(engine.model, prompt_ids, 8)
    ours, theirs = [], []
    for _ in range(args.runs):
        ours.append(ours_run(engine, prompt_ids, args.tokens))
        theirs.append(generate_run(engine.model, prompt_ids, args.tokens))
    for clock in ("wall", "cpu"):
        ours_tps = [args.tokens / getattr(timer, clock) for timer in ours]
        theirs_tps = [args.tokens / getattr(timer, clock) for timer in theirs]
        ratio = statistics.median(ours_tps) / statistics.median(theirs_tps)
        print(f"[{clock} time] our loop (block 1): {statistics.median(ours_tps):7.1f} tok/s  "
              f"transformers generate(): {statistics.median(theirs_tps):7.1f} tok/s  "
              f"ratio {ratio:.3f} (bar >= {BAR}: {'PASS' if ratio >= BAR else 'FAIL'})")
        print(f"    runs ours {[round(x, 1) for x in ours_tps]}  "
              f"theirs {[round(x, 1) for x in theirs_tps]}")

if __name__ == "__main__":
    main()
