"""The MLX drafter's batched proposals (drafter/batch_mlx.py) are each session's own: sessions
at different contexts drafting chains and trees of different widths in one pass propose what
their own propose / propose_tree would, and leave the context cache it would (the next round
agrees too); DFlash 2 drafters draft session by session.
"""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("torch")

from tiny_models import DFLASH2, VOCAB, make_drafter, make_target

from dflash_local.drafter import batch_mlx, model_mlx
from dflash_local.drafter.batch_mlx import DraftRequest
from dflash_local.drafter.model_mlx import DraftSession

HIDDEN = 64
CONTEXTS = [7, 2, 12]  # each session's prompt rows
ROUNDS = [[(16, False), (1 + 5, True), (4, False)],  # (block width, tree) per session and round
          [(3, True), (16, False), (8, True)]]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("target"), layers=4, hidden=HIDDEN)


def _drafter(path):
    drafter = model_mlx.load_drafter(path)
    embed = model_mlx.nn.Embedding(VOCAB, HIDDEN)
    embed.weight = mx.array(np.random.default_rng(0).normal(0, 0.5, (VOCAB, HIDDEN)).astype(np.float32))
    return drafter.bind(embed, embed.as_linear)


def _taps(drafter, rows: int, seed: int) -> mx.array:
    width = len(drafter.config.target_layer_ids) * HIDDEN
    return mx.array(np.random.default_rng(seed).normal(0, 1, (1, rows, width)).astype(np.float32))


def _alone(session, request: DraftRequest):
    if request.tree:
        return session.propose_tree(request.anchor_id, request.new_taps, request.width - 1)
    return session.propose(request.anchor_id, request.new_taps, request.width)


def _assert_same_draft(got, expected):
    """A chain's tokens, a tree's nodes exactly; its path probabilities to float32 rounding
    (the head ran over more rows)."""
    if isinstance(expected, list):
        assert got == expected
        return
    assert (got.token_ids, got.parents) == (expected.token_ids, expected.parents)
    np.testing.assert_allclose(got.path_probs, expected.path_probs, rtol=1e-4, atol=1e-6)


def _rounds_equal(drafter, window=None):
    own = [DraftSession(drafter, window) for _ in CONTEXTS]
    batched = [DraftSession(drafter, window) for _ in CONTEXTS]
    new_rows = CONTEXTS
    for round_index, shapes in enumerate(ROUNDS):
        requests = [DraftRequest(10 + index, _taps(drafter, rows, 100 * round_index + index), width, tree)
                    for index, (rows, (width, tree)) in enumerate(zip(new_rows, shapes))]
        expected = [_alone(session, request) for session, request in zip(own, requests)]
        for got, want in zip(DraftSession.propose_batch(batched, requests), expected, strict=True):
            _assert_same_draft(got, want)
        assert [session.cache.end for session in batched] == [session.cache.end for session in own]
        new_rows = [3, 1, 5]  # the rows each round committed


@pytest.mark.parametrize("window", [None, 6])
def test_batched_proposals_are_each_sessions_own(tmp_path, target_dir, window):
    drafter = _drafter(make_drafter(tmp_path / "d", target_dir, layers=2))
    assert batch_mlx.batches([DraftSession(drafter)] * 2, [DraftRequest(1, _taps(drafter, 1, 0), 4)] * 2)
    _rounds_equal(drafter, window)


def test_sliding_and_causal_drafter_layers_batch(tmp_path, target_dir):
    drafter = _drafter(make_drafter(tmp_path / "d", target_dir, layers=3, seed=4, sliding_window=5,
                                    layer_types=["sliding_attention", "full_attention", "sliding_attention"]))
    _rounds_equal(drafter)


def test_a_dflash2_drafter_drafts_session_by_session(tmp_path, target_dir):
    drafter = _drafter(make_drafter(tmp_path / "d", target_dir, layers=2, dflash2=DFLASH2))
    assert not batch_mlx.batches([DraftSession(drafter)] * 2, [DraftRequest(1, _taps(drafter, 1, 0), 4)] * 2)
    _rounds_equal(drafter)


def test_sessions_of_two_drafters_are_refused(tmp_path, target_dir):
    path = make_drafter(tmp_path / "d", target_dir, layers=2)
    sessions = [DraftSession(_drafter(path)), DraftSession(_drafter(path))]
    requests = [DraftRequest(1, _taps(sessions[0].model, 2, 0), 4)] * 2
    with pytest.raises(ValueError, match="sessions of one drafter, got 2 drafters"):
        DraftSession.propose_batch(sessions, requests)
    with pytest.raises(ValueError, match="2 sessions and 1 requests"):
        DraftSession.propose_batch(sessions, requests[:1])
