"""The MLX engine is lossless: speculative == plain, token for token (greedy, float32), on tiny
random Qwen3, Llama and Qwen3.5-hybrid targets with z-lab-format drafters; and it matches the
Transformers engine on the same pair (same tokens, same accepted-per-round sequence).

Random drafters accept next to nothing, so every case also runs with a scripted drafter that
wraps the real one and is right for the first k positions of each block, k cycling through
B-1, 0, 1, B/2, B-2: that forces rollbacks of 0 < accepted < B-1 rows (GatedDeltaNet replay included), and full acceptance.
"""

from __future__ import annotations

import json
import logging

import pytest

pytest.importorskip("mlx.core")

from mlx_tiny import write_target
from tiny_models import VOCAB, make_drafter

from dflash_local.engines.mlx_engine import MLXEngine
from dflash_local.events import GenerationParams, GenerationStats, parse_block_size

PROMPT = [1, 40, 71, 88, 101, 33, 72, 99, 12, 250, 5, 64]
MAX_TOKENS = 40
BLOCK_SIZES = [2, 4, 16]


class ScriptedDrafter:
    """Runs the real drafter (its cache stays in step), then proposes the known continuation
    for the first `right` positions and wrong tokens after: all right, none, one, half, all
    but one, cyclically."""

    tree_drafts = False

    def __init__(self, inner, reference: list[int]):
        self.inner, self.reference = inner, reference
        self.drafter_block = inner.drafter_block
        self.position = None  # index in the output of the current anchor
        self.rounds = 0

    def propose(self, anchor_id, new_taps, width):
        self.inner.propose(anchor_id, new_taps, width)
        self.position = 0 if self.position is None else self.position + new_taps.shape[1]
        right = [width - 1, 0, 1, width // 2, width - 2][self.rounds % 5]
        self.rounds += 1
        truth = self.reference[self.position + 1 : self.position + width]
        return truth[:right] + [(token + 1) % VOCAB for token in truth[right:]]


def run(engine, block_size: int | None, reference: list[int] | None = None):
    """Greedy generation through the engine; returns (tokens, accepted-per-round)."""
    params = GenerationParams(
        max_tokens=MAX_TOKENS, speculative=block_size is not None, block_size=parse_block_size(block_size),
        stop_token_ids=(-1,),  # random targets emit EOS early: never stop on it here
    )
    if reference is not None:
        real_factory = type(engine).make_drafter.__get__(engine)
        engine.make_drafter = lambda window=None: ScriptedDrafter(real_factory(window), reference)
    stats = GenerationStats()
    tokens = []
    try:
        for event in engine.stream(PROMPT, params):
            stats.add(event)
            tokens.extend(event.token_ids)
    finally:
        engine.__dict__.pop("make_drafter", None)
    return tokens, stats.accepted_per_round


def _drafter_for(tmp_path, target_dir, block_size=16, seed=1):
    """A z-lab-format drafter; hybrid configs nest the LM, so hand make_drafter a flat view."""
    raw = json.loads((target_dir / "config.json").read_text())
    flat = tmp_path / "flat_config"
    flat.mkdir(exist_ok=True)
    (flat / "config.json").write_text(json.dumps(raw.get("text_config") or raw))
    return make_drafter(tmp_path / "drafter", flat, seed=seed, layers=2, block_size=block_size,
                        taps=[1, 3, 4])


@pytest.fixture(scope="module", params=["qwen3", "llama", "qwen3_5"])
def mlx_engine(request, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp(request.param)
    target_dir = write_target(tmp_path / "target", request.param, seed=3)
    return MLXEngine(target_dir, _drafter_for(tmp_path, target_dir))


@pytest.fixture(scope="module")
def plain_tokens(mlx_engine):
    tokens, rounds = run(mlx_engine, None)
    assert len(tokens) == MAX_TOKENS and set(rounds) == {1}
    assert len(set(tokens)) > 5, "a degenerate target would hide rollback bugs"
    return tokens


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_speculative_equals_plain_with_real_drafter(mlx_engine, plain_tokens, block_size):
    tokens, _ = run(mlx_engine, block_size)
    assert tokens == plain_tokens


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_speculative_equals_plain_with_partial_acceptance(mlx_engine, plain_tokens, block_size):
    tokens, per_round = run(mlx_engine, block_size, reference=plain_tokens)
    assert tokens == plain_tokens
    assert max(per_round) == block_size  # a fully accepted block (bonus included)
    if block_size >= 4:
        assert any(1 < accepted < block_size for accepted in per_round)  # partial rollback


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def engine_pair(request, tmp_path_factory):
    """One HF-format directory both engines load: same weights, same drafter checkpoint."""
    torch_engine = pytest.importorskip("dflash_local.engines.torch_engine")
    import torch

    tmp_path = tmp_path_factory.mktemp(f"pair_{request.param}")
    target_dir = write_target(tmp_path / "target", request.param, seed=5)
    drafter_dir = _drafter_for(tmp_path, target_dir, seed=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 intra-op threads on a busy 2-core box: ~100x slower steps
    yield MLXEngine(target_dir, drafter_dir), torch_engine.TorchEngine(target_dir, drafter_dir)
    torch.set_num_threads(threads)


@pytest.mark.parametrize("block_size", [None, 4, 16])
def test_mlx_matches_transformers_engine(engine_pair, block_size):
    mlx_run, torch_run = (run(engine, block_size) for engine in engine_pair)
    assert mlx_run == torch_run


@pytest.mark.parametrize("block_size", [4, 16])
def test_mlx_matches_transformers_engine_with_partial_acceptance(engine_pair, block_size):
    reference, _ = run(engine_pair[1], None)
    mlx_run, torch_run = (run(engine, block_size, reference) for engine in engine_pair)
    assert mlx_run == torch_run
    assert any(1 < accepted < block_size for accepted in mlx_run[1])


def test_quantized_target_runs_lossless_and_warns(tmp_path, caplog):
    target_dir = write_target(tmp_path / "target", "qwen3", seed=3, quantize_bits=8)
    with caplog.at_level(logging.WARNING, logger="dflash_local.engines.mlx_engine"):
        engine = MLXEngine(target_dir, _drafter_for(tmp_path, target_dir))
    assert "quantized target" in caplog.text
    plain, _ = run(engine, None)
    assert run(engine, 16, reference=plain)[0] == plain
