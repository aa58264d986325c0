"""Overhead of our loop: plain decoding through speculative.generate (block size 1) on the MLX
engine vs `mlx_lm.stream_generate` on the same model, same prompt, same token count.

The bar is >= 0.9x mlx-lm's decode tokens/s. Runs alternate between the two (this machine is
shared), and the median of each is reported.

    .venv/bin/python scripts/experiments/bench_overhead_mlx.py [--tokens 128] [--runs 5] [--target DIR]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from mlx_verify_cost import write_random_qwen3

from dflash_local.engines import engine_class_for
from dflash_local.events import GenerationParams, GenerationStats

MLXEngine = engine_class_for("mlx")  # the fast BLAS before MLX, as load_engine does

BAR = 0.9


def ours_tokens_per_s(engine: MLXEngine, prompt_ids: list[int], tokens: int) -> float:
    params = GenerationParams(max_tokens=tokens, speculative=False, stop_token_ids=(-1,))
    stats = GenerationStats()
    for event in engine.stream(prompt_ids, params):
        stats.add(event)
    assert stats.completion_tokens == tokens
    return stats.decode_tokens_per_s


def mlx_lm_tokens_per_s(engine: MLXEngine, wrapper, prompt_ids: list[int], tokens: int) -> float:
    from mlx_lm import stream_generate

    last = None
    for last in stream_generate(engine.model, wrapper, prompt_ids, max_tokens=tokens):
        pass
    assert last.generation_tokens == tokens
    return last.generation_tps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--target", type=Path, help="an mlx-lm target dir (default: random 50M Qwen3)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        target = args.target or write_random_qwen3(Path(tmp) / "qwen3-50m")
        engine = MLXEngine(target, None)
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    wrapper = TokenizerWrapper(engine.tokenizer)
    wrapper.eos_token_ids = []  # random weights emit EOS anywhere: both sides run to --tokens
    prompt_ids = engine.encode_raw("def fibonacci(n):\n    " * 8)
    ours, theirs = [], []
    for _ in range(args.runs):
        ours.append(ours_tokens_per_s(engine, prompt_ids, args.tokens))
        theirs.append(mlx_lm_tokens_per_s(engine, wrapper, prompt_ids, args.tokens))
    ours_tps, theirs_tps = statistics.median(ours), statistics.median(theirs)
    ratio = ours_tps / theirs_tps
    print(f"our loop (block 1): {ours_tps:7.1f} tok/s   runs {[round(x, 1) for x in ours]}")
    print(f"mlx_lm.stream_generate: {theirs_tps:7.1f} tok/s   runs {[round(x, 1) for x in theirs]}")
    print(f"ratio {ratio:.3f}  (bar >= {BAR}: {'PASS' if ratio >= BAR else 'FAIL'})")


if __name__ == "__main__":
    main()
