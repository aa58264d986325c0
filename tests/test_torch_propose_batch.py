"""`DraftSession.propose_batch` / `propose_tree_batch` leave every session as its own pass would:
sessions at different context lengths (a draft window among them), blocks of different widths,
chains then trees in one ragged drafter pass each give every session its own proposals and its
own context cache. Tiny Qwen3 pairs with a v1 drafter, one with a causal sliding-window layer, a
DFlash 2 drafter (convolutions within each block, a candidate selector), and the embedded pair
(DFlash 2)."""

from __future__ import annotations

import pytest
import tiny_models
import torch
from fixtures_tiny import tiny_engine, tiny_pair

from dflash_local import paths
from dflash_local.drafter.model_torch import DraftSession
from dflash_local.engines.torch_engine import TorchEngine

PROMPTS = [[5, 17, 99, 42, 7], [9, 250, 31, 8, 64, 120, 11, 9, 14, 15, 16, 30, 31, 32, 33, 34],
           [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]]
WIDTHS = [16, 4, 9]
NODES = [6, 3, 10]


@pytest.fixture(scope="module", params=["qwen3-v1", "qwen3-sliding", "qwen3-dflash2", "embedded"])
def engine(request, tmp_path_factory):
    if request.param == "embedded":
        target = request.getfixturevalue("embedded_target_dir")
        return TorchEngine(target, paths.shipped_models_dir() / "smollm2-135m-dflash")
    if request.param == "qwen3-dflash2":
        return tiny_engine(tiny_pair(tmp_path_factory, "qwen3", block_size=16,
                                     dflash2=tiny_models.DFLASH2))
    if request.param == "qwen3-sliding":  # a causal sliding layer: masks per session
        return tiny_engine(tiny_pair(tmp_path_factory, "qwen3", block_size=16, sliding_window=6,
                                     layer_types=["sliding_attention", "full_attention"]))
    return tiny_engine(tiny_pair(tmp_path_factory, "qwen3"))


def prompt_taps(engine) -> list[torch.Tensor]:
    taps = []
    for prompt in PROMPTS:
        runner = engine.make_runner(collect_taps=True)
        taps.append(runner.prefill(prompt)[1])
    return taps


def sessions(engine) -> list[DraftSession]:
    """Three sessions, the last with a draft window shorter than its context."""
    return [DraftSession(engine.drafter), DraftSession(engine.drafter),
            DraftSession(engine.drafter, window=8)]


def assert_same_caches(alone: list[DraftSession], batched: list[DraftSession]) -> None:
    for session, session_batched in zip(alone, batched):
        assert (session_batched.cache.start, session_batched.cache.end) == (
            session.cache.start, session.cache.end)
        for keys, keys_batched in zip(session.cache.keys, session_batched.cache.keys):
            torch.testing.assert_close(keys_batched, keys, atol=1e-5, rtol=1e-5)


def test_each_session_drafts_as_it_would_alone(engine):
    taps = prompt_taps(engine)
    alone, batched = sessions(engine), sessions(engine)
    anchors = [21, 22, 23]
    expected = [session.propose(anchor, session_taps, width)
                for session, anchor, session_taps, width in zip(alone, anchors, taps, WIDTHS)]
    assert DraftSession.propose_batch(batched, anchors, taps, WIDTHS) == expected
    assert_same_caches(alone, batched)
    new_rows = [session_taps[:, :rows] for session_taps, rows in zip(taps, [1, 3, 2])]
    expected = [session.propose_tree(7, rows, nodes)
                for session, rows, nodes in zip(alone, new_rows, NODES)]
    trees = DraftSession.propose_tree_batch(batched, [7, 7, 7], new_rows, NODES)
    assert [tree.token_ids for tree in trees] == [tree.token_ids for tree in expected]
    assert [tree.parents for tree in trees] == [tree.parents for tree in expected]
    assert_same_caches(alone, batched)


def test_mismatched_arguments_are_refused(engine):
    taps = prompt_taps(engine)
    with pytest.raises(ValueError, match="3 sessions, 2 anchors, 3 taps, 3 widths"):
        DraftSession.propose_batch(sessions(engine), [1, 2], taps, WIDTHS)


def test_a_session_with_no_new_taps_drafts_as_alone(engine):
    """A session whose round brought no new context rows (its taps [1, 0, taps*H]) beside one
    that did, chains then trees: each its own proposals and cache."""
    taps = prompt_taps(engine)
    alone, batched = sessions(engine), sessions(engine)
    for session, session_taps in zip(alone, taps):
        session.propose(21, session_taps, 4)
    DraftSession.propose_batch(batched, [21, 21, 21], taps, [4, 4, 4])
    new_rows = [taps[0][:, :0], taps[1][:, :2], taps[2][:, :0]]
    expected = [session.propose(7, rows, width)
                for session, rows, width in zip(alone, new_rows, WIDTHS)]
    assert DraftSession.propose_batch(batched, [7, 7, 7], new_rows, WIDTHS) == expected
    assert_same_caches(alone, batched)
    expected = [session.propose_tree(8, rows[:, :0], nodes)
                for session, rows, nodes in zip(alone, new_rows, NODES)]
    trees = DraftSession.propose_tree_batch(batched, [8, 8, 8], [rows[:, :0] for rows in new_rows],
                                            NODES)
    assert [tree.token_ids for tree in trees] == [tree.token_ids for tree in expected]
    assert_same_caches(alone, batched)


def test_a_pass_failing_between_layers_leaves_every_cache_as_it_was(engine):
    """The first layer's block attention raises after that layer appended its context rows:
    every session's cache is as before the pass, and the next round is each session's own."""
    taps = prompt_taps(engine)
    alone, batched = sessions(engine), sessions(engine)
    for session, session_taps in zip(alone, taps):
        session.propose(21, session_taps, 4)
    DraftSession.propose_batch(batched, [21] * 3, taps, [4] * 3)
    before = [(list(s.cache.keys), s.cache.start, s.cache.end) for s in batched]

    def failing(*args, **kwargs):
        raise RuntimeError("block attention failed")

    attention = engine.drafter.layers[0].self_attn
    attention.block_qkv = failing
    try:
        with pytest.raises(RuntimeError, match="block attention failed"):
            DraftSession.propose_batch(batched, [7] * 3, taps, WIDTHS)
    finally:
        del attention.block_qkv
    for session, (keys, start, end) in zip(batched, before):
        assert (session.cache.start, session.cache.end) == (start, end)
        assert all(now is then for now, then in zip(session.cache.keys, keys))
    expected = [session.propose(7, session_taps, width)
                for session, session_taps, width in zip(alone, taps, WIDTHS)]
    assert DraftSession.propose_batch(batched, [7] * 3, taps, WIDTHS) == expected
    assert_same_caches(alone, batched)
