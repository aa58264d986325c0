"""Cost of a 16-row verify over a 1-row step on the MLX engine, with and without the BLAS fix.

The ratio decides what speculative decoding can gain (DFLASH.md): it runs the engine's own
MLXTargetRunner on a random ~50M-parameter Qwen3 (float32, context 256, 3 taps collected), once
in a child process with DFLASH_BLAS=off (the wheel's reference BLAS) and once as users get it.

    .venv/bin/python scripts/experiments/mlx_verify_cost.py [--context 256] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QWEN3_50M = {
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 512,
    "num_hidden_layers": 12, "intermediate_size": 1536, "num_attention_heads": 8,
    "num_key_value_heads": 4, "head_dim": 64, "rms_norm_eps": 1e-6, "vocab_size": 32000,
    "max_position_embeddings": 4096, "rope_theta": 1_000_000.0, "tie_word_embeddings": True,
    "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "float32",
}


def write_random_qwen3(out: Path, seed: int = 0) -> Path:
    """A random ~50M Qwen3 directory that mlx_lm.load (and transformers) read, with a tokenizer
    whose vocabulary covers every id (byte-level BPE, no merges, filler pairs)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models import qwen3

    model = qwen3.Model(qwen3.ModelArgs.from_dict(QWEN3_50M))
    mx.random.seed(seed)
    params = [(name, 0.05 * mx.random.normal(value.shape) if value.ndim == 2 else value)
              for name, value in tree_flatten(model.parameters())]
    model.update(tree_unflatten(params))
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(params), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(QWEN3_50M, indent=2))
    _write_tokenizer(out, QWEN3_50M["vocab_size"])
    return out


def _write_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = specials + alphabet
    tokens += [a + b for a in alphabet for b in alphabet][: vocab_size - len(tokens)]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                            pad_token="<|endoftext|>").save_pretrained(out)


def measure(target_dir: Path, context: int, repeats: int) -> dict:
    """Median wall time of verify(16)+commit(1) and of verify(1)+commit(1) at `context`."""
    from dflash_local.accel import blas
    from dflash_local.engines import engine_class_for

    MLXEngine = engine_class_for("mlx")  # the fast BLAS first, as load_engine does
    from dflash_local.engines.mlx_engine import MLXTargetRunner

    engine = MLXEngine(target_dir, None)
    runner = MLXTargetRunner(engine.model, engine.adapter, (1, 6, 10), max_context=4096)
    runner.prefill(list(range(3, 3 + context)))
    timings = {1: [], 16: []}
    for _ in range(repeats):
        for width in (1, 16):
            start = time.perf_counter()
            runner.verify_chain([7] * width)
            runner.commit([0])  # width 16: rolls 15 rows back, as a round with nothing accepted
            timings[width].append(time.perf_counter() - start)
    step_ms, verify_ms = (statistics.median(timings[w]) * 1e3 for w in (1, 16))
    status = blas.blas_status(warn=False)
    return {"blas": status.library or "bundled reference BLAS", "gflops": round(status.gflops, 1),
            "step_ms": round(step_ms, 2), "verify16_ms": round(verify_ms, 2),
            "ratio": round(verify_ms / step_ms, 2)}


def run_child(target_dir: Path, args, blas_off: bool) -> dict:
    env = dict(os.environ)
    if blas_off:
        env["DFLASH_BLAS"] = "off"
    command = [sys.executable, __file__, "--child", str(target_dir),
               "--context", str(args.context), "--repeats", str(args.repeats)]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.context, args.repeats)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        target_dir = write_random_qwen3(Path(tmp) / "qwen3-50m")
        for label, blas_off in (("without fix (DFLASH_BLAS=off)", True), ("with fix", False)):
            result = run_child(target_dir, args, blas_off)
            print(f"{label:32s} verify(16)/step(1) = {result['ratio']:5.2f}x  "
                  f"(step {result['step_ms']} ms, verify16 {result['verify16_ms']} ms, "
                  f"matmul {result['gflops']} GFLOP/s, {result['blas']})")


if __name__ == "__main__":
    main()
