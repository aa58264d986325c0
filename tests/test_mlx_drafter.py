"""The MLX drafter is the same model as the torch drafter and as z-lab's MLX reference.

Same z-lab-format checkpoint, same borrowed embedding/head, same taps: logits must agree in
float32 over several rounds (the context cache carries across rounds, windowed or not).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
torch = pytest.importorskip("torch")

from mlx_tiny import zlab_mlx_config
from tiny_models import VOCAB, make_drafter, make_target

from dflash_local.drafter import model_mlx, model_torch
from dflash_local.errors import CheckpointError

HIDDEN = 64
ROUNDS = [(5, 16), (3, 16), (1, 4), (7, 8)]  # (new context rows, block width) per round


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("target"), layers=4, hidden=HIDDEN)


@pytest.fixture(scope="module")
def embedding():
    return np.random.default_rng(0).normal(0, 0.5, (VOCAB, HIDDEN)).astype(np.float32)


def _torch_pair(path, embedding):
    drafter = model_torch.load_drafter(path)
    weight = torch.from_numpy(embedding)
    embed = torch.nn.Embedding.from_pretrained(weight)
    return drafter.bind(embed, lambda hidden: hidden @ weight.T)


def _mlx_pair(path, embedding):
    drafter = model_mlx.load_drafter(path)
    embed = model_mlx.nn.Embedding(VOCAB, HIDDEN)
    embed.weight = mx.array(embedding)
    return drafter.bind(embed, embed.as_linear)


def _rounds(taps_width: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for new_rows, width in ROUNDS:
        taps = rng.normal(0, 1, (1, new_rows, taps_width)).astype(np.float32)
        block = [int(rng.integers(4, VOCAB))] + [3] * (width - 1)
        yield taps, block


def _compare_to_torch(path, embedding, window=None):
    torch_drafter, mlx_drafter = _torch_pair(path, embedding), _mlx_pair(path, embedding)
    torch_cache, mlx_cache = torch_drafter.new_cache(window), mlx_drafter.new_cache(window)
    width = len(mlx_drafter.config.target_layer_ids) * HIDDEN
    for taps, block in _rounds(width):
        with torch.inference_mode():
            hidden = torch_drafter.draft(torch.tensor([block]), torch.from_numpy(taps), torch_cache)
            expected = torch_drafter.logits(hidden[:, 1:]).numpy()
        hidden = mlx_drafter.draft(mx.array([block]), mx.array(taps), mlx_cache)
        got = np.array(mlx_drafter.logits(hidden[:, 1:]))
        np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)
        assert mlx_cache.end == torch_cache.end


def test_v1_logits_equal_torch(tmp_path, target_dir, embedding):
    path = make_drafter(tmp_path / "d", target_dir, layers=2)
    _compare_to_torch(path, embedding)


def test_windowed_context_equals_torch(tmp_path, target_dir, embedding):
    path = make_drafter(tmp_path / "d", target_dir, layers=2)
    _compare_to_torch(path, embedding, window=6)


def test_sliding_and_causal_layers_equal_torch(tmp_path, target_dir, embedding):
    path = make_drafter(
        tmp_path / "d", target_dir, layers=3, seed=4, sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )
    _compare_to_torch(path, embedding)
    _compare_to_torch(path, embedding, window=9)


def test_forced_causal_and_scales_equal_torch(tmp_path, target_dir, embedding):
    path = make_drafter(tmp_path / "d", target_dir, layers=2, seed=5, is_causal=True)
    raw = json.loads((path / "config.json").read_text())
    raw["dflash_config"].update(
        input_embedding_scale=2.0, output_multiplier=0.5, final_logit_softcapping=3.0
    )
    (path / "config.json").write_text(json.dumps(raw))
    _compare_to_torch(path, embedding)


def test_logits_equal_zlab_reference(tmp_path, target_dir, embedding):
    zlab = pytest.importorskip("dflash.model_mlx", reason="z-lab's dflash.model_mlx did not import")
    path = make_drafter(tmp_path / "d", target_dir, layers=2, seed=7)
    ours = _mlx_pair(path, embedding)
    config = ours.config
    reference = zlab.DFlashDraftModel(zlab_mlx_config(zlab, config, 4))
    reference.load_weights(list(mx.load(str(path / "model.safetensors")).items()))
    reference.embed_tokens, reference.lm_head = ours.borrowed.embed_tokens, ours.borrowed.lm_head
    reference_cache, our_cache = reference.make_cache(), ours.new_cache()
    for taps, block in _rounds(len(config.target_layer_ids) * HIDDEN, seed=3):
        expected = np.array(reference(mx.array([block]), mx.array(taps), reference_cache)[:, 1:])
        got = np.array(ours.logits(ours.draft(mx.array([block]), mx.array(taps), our_cache)[:, 1:]))
        np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)


def test_draft_session_proposes_argmax(tmp_path, target_dir, embedding):
    path = make_drafter(tmp_path / "d", target_dir, layers=2, block_size=8)
    drafter = _mlx_pair(path, embedding)
    session = model_mlx.DraftSession(drafter)
    taps = mx.array(np.ones((1, 3, 2 * HIDDEN), np.float32))
    proposal = session.propose(9, taps, width=5)
    assert session.drafter_block == 8 and len(proposal) == 4
    assert all(isinstance(token, int) and 0 <= token < VOCAB for token in proposal)


def test_truncated_checkpoint_is_a_checkpoint_error(tmp_path, target_dir):
    path = make_drafter(tmp_path / "d", target_dir)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        model_mlx.load_drafter(path)


def test_missing_weight_is_a_checkpoint_error(tmp_path, target_dir):
    path = make_drafter(tmp_path / "d", target_dir)
    weights = dict(mx.load(str(path / "model.safetensors")))
    del weights["layers.0.mlp.up_proj.weight"]
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    with pytest.raises(CheckpointError, match="missing.*layers.0.mlp.up_proj.weight"):
        model_mlx.load_drafter(path)
