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
from dflash_local.drafter.model_mlx import DraftSession

HIDDEN = 64
CONTEXTS = [7, 2, 12]  # each session's prompt rows
# per round: chains (block widths) or trees (nodes), one per session
ROUNDS = [("chain", [16, 2, 4]), ("tree", [5, 15, 2]), ("chain", [8, 16, 3])]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("target"), layers=4, hidden=HIDDEN)


def _drafter(path):
    drafter = model_mlx.load_drafter(path)
    embed = model_mlx.nn.Embedding(VOCAB, HIDDEN)
    embed.weight = mx.array(np.random.default_rng(0).normal(0, 0.05, (VOCAB, HIDDEN)).astype(np.float32))
    return drafter.bind(embed, embed.as_linear)


def _taps(drafter, rows: int, seed: int) -> mx.array:
    width = len(drafter.config.target_layer_ids) * HIDDEN
    return mx.array(np.random.default_rng(seed).normal(0, 1, (1, rows, width)).astype(np.float32))


def _assert_same_draft(got, expected):
    """A chain's tokens, a tree's nodes exactly; its path probabilities to float32 rounding
    (the head ran over more rows)."""
    if isinstance(expected, list):
        assert got == expected
        return
    assert (got.token_ids, got.parents) == (expected.token_ids, expected.parents)
    np.testing.assert_allclose(got.path_probs, expected.path_probs, rtol=1e-5, atol=1e-7)


def _rounds_equal(drafter, window=None):
    own = [DraftSession(drafter, window) for _ in CONTEXTS]
    batched = [DraftSession(drafter, window) for _ in CONTEXTS]
    new_rows = CONTEXTS
    for round_index, (kind, sizes) in enumerate(ROUNDS):
        anchors = [10 + index for index in range(len(own))]
        taps = [_taps(drafter, rows, 100 * round_index + index) for index, rows in enumerate(new_rows)]
        if kind == "chain":
            expected = [session.propose(*request) for session, request in zip(own, zip(anchors, taps, sizes))]
            got = DraftSession.propose_batch(batched, anchors, taps, sizes)
        else:
            expected = [session.propose_tree(*request) for session, request in zip(own, zip(anchors, taps, sizes))]
            got = DraftSession.propose_tree_batch(batched, anchors, taps, sizes)
        for one, want in zip(got, expected, strict=True):
            _assert_same_draft(one, want)
        assert [session.cache.end for session in batched] == [session.cache.end for session in own]
        new_rows = [3, 1, 5]  # the rows each round committed


@pytest.mark.parametrize("window", [None, 6])
def test_batched_proposals_are_each_sessions_own(tmp_path, target_dir, window):
    drafter = _drafter(make_drafter(tmp_path / "d", target_dir, layers=2))
    assert batch_mlx.batches([DraftSession(drafter)] * 2, [1, 1], [_taps(drafter, 1, 0)] * 2, [4, 4])
    _rounds_equal(drafter, window)


def test_sliding_and_causal_drafter_layers_batch(tmp_path, target_dir):
    drafter = _drafter(make_drafter(tmp_path / "d", target_dir, layers=3, seed=4, sliding_window=5,
                                    layer_types=["sliding_attention", "full_attention", "sliding_attention"]))
    _rounds_equal(drafter)


def test_a_dflash2_drafter_drafts_session_by_session(tmp_path, target_dir):
    drafter = _drafter(make_drafter(tmp_path / "d", target_dir, layers=2, dflash2=DFLASH2))
    assert not batch_mlx.batches([DraftSession(drafter)] * 2, [1, 1], [_taps(drafter, 1, 0)] * 2, [4, 4])
    _rounds_equal(drafter)


def test_sessions_of_two_drafters_are_refused(tmp_path, target_dir):
    path = make_drafter(tmp_path / "d", target_dir, layers=2)
    sessions = [DraftSession(_drafter(path)), DraftSession(_drafter(path))]
    taps = [_taps(sessions[0].model, 2, 0)] * 2
    with pytest.raises(ValueError, match="sessions of one drafter, got 2 drafters"):
        DraftSession.propose_batch(sessions, [1, 1], taps, [4, 4])
    with pytest.raises(ValueError, match="2 sessions, 1 anchors, 2 taps, 2 widths"):
        DraftSession.propose_tree_batch(sessions, [1], taps, [3, 3])


@pytest.mark.parametrize("window", [None, 6])
def test_a_pass_failing_between_layers_leaves_every_cache_as_it_was(tmp_path, target_dir, window):
    """The second layer's attention raises after the first layer appended its context rows:
    every session's caches are as before the pass, and the next round is each session's own."""
    drafter = _drafter(make_drafter(tmp_path / "d", target_dir, layers=2))
    own = [DraftSession(drafter, window) for _ in CONTEXTS]
    batched = [DraftSession(drafter, window) for _ in CONTEXTS]
    taps = [_taps(drafter, rows, index) for index, rows in enumerate(CONTEXTS)]
    for session, session_taps in zip(own, taps):
        session.propose(9, session_taps, 4)
    DraftSession.propose_batch(batched, [9] * 3, taps, [4] * 3)
    offsets = [[layer.offset for layer in session.cache.layers] for session in batched]
    new_taps = [_taps(drafter, 2 * window if window else 3, 50 + index) for index in range(3)]

    def failing(*args, **kwargs):
        raise RuntimeError("layer 1 failed")

    attention = drafter.layers[1].self_attn
    attention.block_qkv = failing
    try:
        with pytest.raises(RuntimeError, match="layer 1 failed"):
            DraftSession.propose_batch(batched, [9] * 3, new_taps, [4] * 3)
    finally:
        del attention.block_qkv
    assert [[layer.offset for layer in session.cache.layers] for session in batched] == offsets
    assert [session.cache.end for session in batched] == CONTEXTS
    expected = [session.propose(9, session_taps, 5) for session, session_taps in zip(own, new_taps)]
    assert DraftSession.propose_batch(batched, [9] * 3, new_taps, [5] * 3) == expected


def test_a_session_with_no_new_taps_drafts_as_alone(tmp_path, target_dir):
    """A round that brought a session no new context rows (taps [1, 0, taps*H]) beside one that
    did: one pass, each session's own proposals and cache."""
    drafter = _drafter(make_drafter(tmp_path / "d", target_dir, layers=2))
    own, batched = ([DraftSession(drafter, window) for window in (None, None, 6)] for _ in range(2))
    taps = [_taps(drafter, rows, index) for index, rows in enumerate(CONTEXTS)]
    for session, session_taps in zip(own, taps):
        session.propose(9, session_taps, 4)
    DraftSession.propose_batch(batched, [9] * 3, taps, [4] * 3)
    new_taps = [taps[0][:, :0], _taps(drafter, 3, 7), taps[2][:, :0]]
    assert batch_mlx.batches(batched, [8] * 3, new_taps, [5] * 3)
    expected = [session.propose(8, session_taps, 5) for session, session_taps in zip(own, new_taps)]
    assert DraftSession.propose_batch(batched, [8] * 3, new_taps, [5] * 3) == expected
    assert [session.cache.end for session in batched] == [session.cache.end for session in own]
