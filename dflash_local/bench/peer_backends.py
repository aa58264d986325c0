"""The Mac peers as their own Python APIs drive them, inside a peer process (peer_driver.py).

dflash-mlx 0.1.8: `load_runtime_bundle` + `stream_dflash_generate`, as its `generate` command
does (runtime context from its offline defaults, draft quantization its model default: none for
a drafter it does not list). mlx-dspark 0.20.3: `load_target` + `load_dflash` (4-bit by default)
+ the kernels and cap its `generate --mode dflash` command sets up (`static_cap` calibrates once
per machine and pair, cached under the bench's cache dir) + `dflash_generate`. "float32" casts
the loaded drafter's floating weights to float32 and does not quantize it.

The prompt is our token ids (the peers' prompt-ids entry points), greedy. Timings: prefill = up
to the first generated token, decode = from it to the last, as bench/measure.py defines them.
A reply holds at most max_tokens ids: mlx-dspark's last round can commit past its
max_new_tokens, and those tokens (and their share of the rounds) are cut off and counted.
"""

from __future__ import annotations

import importlib
import time
from collections import Counter
from pathlib import Path


def _to_float32(model) -> None:
    import mlx.core as mx

    model.apply(lambda x: x.astype(mx.float32) if mx.issubdtype(x.dtype, mx.floating) else x)


class DflashMlx:
    package = "dflash-mlx"

    def __init__(self, target: Path, drafter: Path, dtype: str, cache_dir: Path, status):
        from dflash_mlx.engine.target_qwen_gdn import QwenGdnTargetOps
        from dflash_mlx.runtime.bundle import load_runtime_bundle
        from dflash_mlx.runtime.context import build_offline_runtime_context

        # THE shim (docs/benchmarks.md): dflash-mlx's pure-attention target backend refuses any
        # model_type without "qwen" in it; lift that one check and keep the shape check after it
        QwenGdnTargetOps.supports_model = QwenGdnTargetOps._has_qwen_text_shape
        self.context = build_offline_runtime_context()
        self.bundle = load_runtime_bundle(model_ref=str(target), draft_ref=str(drafter),
                                          verify_config=self.context.verify)
        if dtype == "float32":
            _to_float32(self.bundle.draft_model)
        self.settings = {"drafter_dtype": dtype, "verify_mode": self.context.verify.mode,
                         "draft_quant": self.bundle.effective_draft_quant}

    def generate(self, request: dict) -> dict:
        from dflash_mlx.engine.events import TokenEvent
        from dflash_mlx.runtime import get_stop_token_ids, stream_dflash_generate

        bundle = self.bundle
        token_ids: list[int] = []
        cycles: list[int] = []  # per token, the rounds completed when it came out
        first = None
        start = time.perf_counter()
        stream = stream_dflash_generate(
            target_model=bundle.target_model, target_ops=bundle.target_ops,
            tokenizer=bundle.tokenizer, draft_model=bundle.draft_model,
            draft_backend=bundle.draft_backend, prompt_tokens_override=list(request["prompt_ids"]),
            max_new_tokens=int(request["max_tokens"]), use_chat_template=False,
            block_tokens=request.get("block_size"),
            stop_token_ids=get_stop_token_ids(bundle.tokenizer), runtime_context=self.context)
        for event in stream:
            if isinstance(event, TokenEvent):
                first = first or time.perf_counter()
                token_ids.append(int(event.token_id))
                cycles.append(int(event.cycles_completed))
        end = time.perf_counter()
        # its per-round events come only with its profiling on: a round's tokens share a count
        committed = list(Counter(cycles[1:]).values())
        return reply_figures(request, token_ids, start, first or end, end, committed)


class MlxDspark:
    package = "mlx-dspark"

    def __init__(self, target: Path, drafter: Path, dtype: str, cache_dir: Path, status):
        from mlx_dspark.load import load_dflash, load_target

        # the module: the package's own `calibrate` name is its function
        calibration = importlib.import_module("mlx_dspark.calibrate")

        cache_dir.mkdir(parents=True, exist_ok=True)
        calibration.CACHE_DIR = str(cache_dir)  # its cache, in a dir the bench names
        if calibration.cached_curve_entry("dflash", str(target), str(drafter))[1] is None:
            status(f"mlx-dspark: calibrating (first use for this pair; cached in {cache_dir})")
        self.target, self.tokenizer = load_target(str(target), require_tap=True)
        self.drafter, _ = load_dflash(str(drafter), quantize=dtype == "default", bits=4)
        if dtype == "float32":
            _to_float32(self.drafter)
        self.drafter.bind(self.target.model)
        repos = {"target_repo": str(target)}
        calibration.apply_small_m(self.target, self.drafter, drafter_repo=str(drafter), **repos)
        calibration.apply_sdpa_split(self.target, **repos)
        calibration.apply_multirow_attn(self.target, self.drafter)
        full_block = max(1, int(self.drafter.config.block_size) - 1)
        self.cap = calibration.static_cap(self.target, self.drafter, mode="dflash",
                                          drafter_repo=str(drafter), fallback=full_block, **repos)
        calibration.apply_wide_gemm(self.target, self.drafter, **repos)
        calibration.apply_cpu_split(self.target, self.drafter, **repos)
        self.settings = {"drafter_dtype": dtype, "drafter_bits": 4 if dtype == "default" else None,
                         "max_draft_tokens": self.cap}

    def generate(self, request: dict) -> dict:
        from mlx_dspark.generate import dflash_generate

        block = request.get("block_size")
        cap = self.cap if block is None else max(1, int(block) - 1)
        start = time.perf_counter()
        result = dflash_generate(
            self.target, self.tokenizer, self.drafter, prompt_ids=list(request["prompt_ids"]),
            max_new_tokens=int(request["max_tokens"]), max_draft_tokens=cap, temperature=0.0,
            seed=request.get("seed"))
        end = time.perf_counter()
        first = start + result.prefill_seconds  # its prefill ends with the first token
        return reply_figures(request, list(result.token_ids), start, first, end,
                        [int(n) for n in result.accept_lengths])


def reply_figures(request: dict, token_ids: list[int], start: float, first: float, end: float,
             committed: list[int]) -> dict:
    # mlx-dspark's drafter rounds commit a whole accepted block even past max_new_tokens (its
    # loop checks the budget only before a round): keep what was asked for, as a caller
    # honouring max_tokens would, and say how many came past it
    kept = token_ids[:int(request["max_tokens"])]
    return {"token_ids": kept, "prompt_tokens": len(request["prompt_ids"]),
            "prefill_s": first - start, "decode_s": end - first,
            "committed_per_round": rounds_within(committed, len(kept) - 1),
            "tokens_past_max": len(token_ids) - len(kept)}


def rounds_within(committed: list[int], decoded: int) -> list[int]:
    """The rounds' committed counts cut to the first `decoded` tokens after the prefill's."""
    rounds: list[int] = []
    for count in committed:
        if decoded <= 0:
            break
        rounds.append(min(count, decoded))
        decoded -= rounds[-1]
    return rounds


BACKENDS = {"dflash-mlx": DflashMlx, "mlx-dspark": MlxDspark}
