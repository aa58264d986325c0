"""The float type a pair runs in when the user says `auto` (the default everywhere).

On a CPU: float32. Speculative decoding is lossless only if the verify pass (many rows) and plain
decoding (one row) give the same argmax; in bfloat16 the two kernel paths round differently and
measured here they did not (8 of 24 embedded-pair generations identical, 96 tokens each), while
float32 is identical in every test (scripts/experiments/torch_verify_cost.py --check-bf16 8). On a GPU (CUDA, Metal): the checkpoint's own type, so an 8B
bf16 target is not doubled to 32 GB; a checkpoint that names none runs in bfloat16.
"""

from __future__ import annotations

from typing import Any

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
DTYPE_CHOICES = ("auto", *FLOAT_DTYPES)


def checkpoint_dtype(config: dict[str, Any]) -> str | None:
    """The float type a Hugging Face config.json (as read by drafter/config.py
    `read_target_config`) declares: `dtype`, or older `torch_dtype`."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    for source in (config, text):
        declared = source.get("dtype") or source.get("torch_dtype")
        if declared in FLOAT_DTYPES:
            return declared
    return None


def resolve_dtype(requested: str, *, accelerator: bool, target_config: dict[str, Any]) -> str:
    if requested != "auto":
        return requested
    if not accelerator:
        return "float32"
    return checkpoint_dtype(target_config) or "bfloat16"
