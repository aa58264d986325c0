"""The MLX DFlash 2 drafter is z-lab's DFlash 2, and the MLX engine stays lossless with it.

Same z-lab-format checkpoint (written by tiny_models with z-lab's names), same borrowed
embedding/head: our hidden states and logits equal z-lab's MLX `DFlash2DraftModel` over several
rounds, and our greedy drafts (the candidate selector's chain) equal its `propose` at
temperature 0. Blocks shorter than the convolution's kernel (the tail of a generation) are
checked against z-lab's MLX reference and a naive convolution written here.
"""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

import tiny_models
from mlx_tiny import write_target, zlab_mlx_config
from tiny_models import DFLASH2, VOCAB, make_drafter, make_target

from dflash_local.drafter import dflash2_mlx, model_mlx
from dflash_local.errors import CheckpointError
from dflash_local.events import AUTO, Fixed, GenerationParams

HIDDEN = 64
KERNEL = DFLASH2["conv_kernel_size"]
ROUNDS = [(5, 16), (3, 4), (1, 16), (7, 8), (2, 5)]  # (new context rows, block width), width >= K
SHORT_ROUNDS = [(5, 2), (3, 3), (1, 2), (4, 1), (2, 3)]  # blocks shorter than the kernel


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("target"), layers=4, hidden=HIDDEN)


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, target_dir):
    return make_drafter(tmp_path_factory.mktemp("drafter"), target_dir, layers=2, seed=7,
                        dflash2=DFLASH2)


@pytest.fixture(scope="module")
def embedding():
    return np.random.default_rng(0).normal(0, 0.5, (VOCAB, HIDDEN)).astype(np.float32)


def _ours(path, embedding):
    drafter = model_mlx.load_drafter(path)
    embed = model_mlx.nn.Embedding(VOCAB, HIDDEN)
    embed.weight = mx.array(embedding)
    return drafter.bind(embed, embed.as_linear)


def _reference(path, ours):
    """z-lab's MLX DFlash2DraftModel on the same weights (its codebooks are Embeddings)."""
    zlab = pytest.importorskip("dflash.model_mlx", reason="z-lab's dflash.model_mlx did not import")
    config = ours.config
    reference = zlab.DFlash2DraftModel(zlab_mlx_config(zlab, config, 4, **DFLASH2))
    weights = dict(mx.load(str(path / "model.safetensors")))
    for name in ("predecessor_codebook", "successor_codebook"):
        weights[f"candidate_selector.{name}.weight"] = weights.pop(f"candidate_selector.{name}")
    reference.load_weights(list(weights.items()))
    reference.embed_tokens, reference.lm_head = ours.borrowed.embed_tokens, ours.borrowed.lm_head
    return reference


def _rounds(rounds, taps_width: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for new_rows, width in rounds:
        taps = rng.normal(0, 1, (1, new_rows, taps_width)).astype(np.float32)
        yield mx.array(taps), [int(rng.integers(4, VOCAB))] + [tiny_models.MASK_ID] * (width - 1)


def test_hidden_states_and_logits_equal_zlab(drafter_dir, embedding):
    ours = _ours(drafter_dir, embedding)
    reference = _reference(drafter_dir, ours)
    reference_cache, our_cache = reference.make_cache(), ours.new_cache()
    for taps, block in _rounds(ROUNDS, 2 * HIDDEN):
        expected = reference.hidden_states(mx.array([block]), taps, reference_cache)
        got = ours.draft(mx.array([block]), taps, our_cache)
        np.testing.assert_allclose(np.array(got), np.array(expected), atol=1e-4, rtol=1e-4)
        expected_logits = reference.compute_logits(expected)
        np.testing.assert_allclose(np.array(ours.logits(got)), np.array(expected_logits),
                                   atol=1e-4, rtol=1e-4)


def _naive_convolve(rows, base, dynamic, group_size):
    """out[j] = sum over offsets o <= j of (base[o] + the group's dynamic weight) * rows[j - o]."""
    rows, base, dynamic = (np.array(a, dtype=np.float64) for a in (rows, base, dynamic))
    out = np.zeros_like(rows)
    for j in range(rows.shape[1]):
        for offset in range(min(base.shape[0], j + 1)):
            weight = base[offset] + np.repeat(dynamic[:, j, offset], group_size, axis=-1)
            out[:, j] += weight * rows[:, j - offset]
    return out


@pytest.mark.parametrize("length", [1, 2, 3, 4, 16])
def test_convolution_equals_naive_sum(length):
    rng = np.random.default_rng(length)
    groups, group_size = 4, 16
    rows = rng.normal(size=(2, length, groups * group_size)).astype(np.float32)
    base = rng.normal(size=(KERNEL, groups * group_size)).astype(np.float32)
    dynamic = rng.normal(size=(2, length, KERNEL, groups)).astype(np.float32)
    got = dflash2_mlx.causal_convolve(mx.array(rows), mx.array(base), mx.array(dynamic), group_size)
    np.testing.assert_allclose(np.array(got), _naive_convolve(rows, base, dynamic, group_size),
                               atol=1e-5, rtol=1e-5)


def test_short_blocks_equal_zlab_and_naive_convolution(drafter_dir, embedding, monkeypatch):
    """Blocks of 1 to 3 rows (kernel 4) between full ones equal z-lab's MLX reference, and the
    drafter with the naive convolution (z-lab's torch convolution fails below K-1 rows)."""
    ours, naive = _ours(drafter_dir, embedding), _ours(drafter_dir, embedding)
    reference = _reference(drafter_dir, ours)
    rounds = list(_rounds(SHORT_ROUNDS + ROUNDS[:2] + [(2, 1)], 2 * HIDDEN, seed=5))
    ours_cache, naive_cache = ours.new_cache(), naive.new_cache()
    reference_cache = reference.make_cache()
    results = []
    for taps, block in rounds:
        got = np.array(ours.draft(mx.array([block]), taps, ours_cache))
        expected = reference.hidden_states(mx.array([block]), taps, reference_cache)
        np.testing.assert_allclose(got, np.array(expected), atol=1e-4, rtol=1e-4)
        results.append(got)
    monkeypatch.setattr(dflash2_mlx, "causal_convolve",
                        lambda *args: mx.array(_naive_convolve(*args).astype(np.float32)))
    for got, (taps, block) in zip(results, rounds, strict=True):
        expected = np.array(naive.draft(mx.array([block]), taps, naive_cache))
        np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)


def test_greedy_drafts_equal_zlab_propose(drafter_dir, embedding):
    ours = _ours(drafter_dir, embedding)
    reference = _reference(drafter_dir, ours)
    session, reference_cache = model_mlx.DraftSession(ours), reference.make_cache()
    for taps, block in _rounds(ROUNDS, 2 * HIDDEN, seed=11):
        path, _, _ = reference.propose(mx.array([block]), taps, reference_cache,
                                       temperature=0.0, logits_start=1)
        assert session.propose(block[0], taps, len(block)) == path[0].tolist()


def test_tree_starts_with_the_greedy_draft(drafter_dir, embedding):
    """The selector tree's best node is the greedy chain's first draft; a chain after it too."""
    ours = _ours(drafter_dir, embedding)
    tree_session, chain_session = model_mlx.DraftSession(ours), model_mlx.DraftSession(ours)
    for taps, block in _rounds(ROUNDS[:3], 2 * HIDDEN, seed=2):
        tree = tree_session.propose_tree(block[0], taps, nodes=len(block) - 1)
        chain = chain_session.propose(block[0], taps, len(block))
        assert len(tree.token_ids) == len(block) - 1 and tree.token_ids[0] == chain[0]
        assert all(parent < node for node, parent in enumerate(tree.parents, start=1))


def test_restricted_draft_vocabulary_drafts_from_it(drafter_dir, embedding):
    ours = _ours(drafter_dir, embedding)
    allowed = list(range(4, VOCAB, 3))
    ours.restrict_draft_vocab(allowed)
    session = model_mlx.DraftSession(ours)
    for taps, block in _rounds(ROUNDS[:3], 2 * HIDDEN, seed=3):
        assert set(session.propose(block[0], taps, len(block))) <= set(allowed)
        assert set(session.propose_tree(block[0], taps, 6).token_ids) <= set(allowed)


def test_codebook_of_wrong_shape_is_refused(tmp_path, target_dir):
    path = make_drafter(tmp_path / "d", target_dir, dflash2=DFLASH2)
    weights = dict(mx.load(str(path / "model.safetensors")))
    name = "candidate_selector.successor_codebook"
    weights[name] = weights[name][:, :3]
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    rank = DFLASH2["selector_rank"]
    shapes = rf"{name} has shape \({VOCAB}, 3\), config implies \({VOCAB}, {rank}\)"
    with pytest.raises(CheckpointError, match=shapes):
        model_mlx.load_drafter(path)


# --- losslessness through the real engine ---

PROMPT = [1, 40, 71, 88, 101, 33, 72, 99, 12, 250, 5, 64]
MAX_TOKENS = 30


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from dflash_local.engines.mlx_engine import MLXEngine

    root = tmp_path_factory.mktemp("dflash2_engine")
    target = write_target(root / "target", "qwen3", seed=3)
    drafter = make_drafter(root / "drafter", target, seed=4, layers=2, taps=[1, 3, 4],
                           dflash2=DFLASH2)
    return MLXEngine(target, drafter)


def _generate(engine, max_tokens=MAX_TOKENS, **fields):
    params = GenerationParams(max_tokens=max_tokens, stop_token_ids=(-1,), **fields)
    events = list(engine.stream(PROMPT, params))
    return [token for event in events for token in event.token_ids], events


@pytest.fixture(scope="module")
def plain_tokens(engine):
    tokens, _ = _generate(engine, speculative=False)
    assert len(tokens) == MAX_TOKENS and len(set(tokens)) > 5
    return tokens


@pytest.mark.parametrize("tree", [True, False])
@pytest.mark.parametrize("block_size", [Fixed(2), Fixed(4), Fixed(16), AUTO])
def test_speculative_equals_plain(engine, plain_tokens, block_size, tree, monkeypatch):
    """Token for token; with trees on, the rounds verify the selector's trees."""
    trees = []
    propose_tree = model_mlx.DraftSession.propose_tree
    monkeypatch.setattr(model_mlx.DraftSession, "propose_tree",
                        lambda *args: trees.append(propose_tree(*args)) or trees[-1])
    tokens, events = _generate(engine, block_size=block_size, tree=tree)
    assert tokens == plain_tokens
    assert any(event.width > 1 for event in events)
    assert bool(trees) == (tree and block_size != Fixed(2))  # a 2-row round is a chain


def test_rounds_shorter_than_the_kernel(engine, plain_tokens):
    """A generation's last rounds shrink to the tokens left: blocks of 3 and 2 rows, shorter
    than the kernel of 4, draft and verify like the others."""
    widths = set()
    for max_tokens in (3, 5):
        tokens, events = _generate(engine, max_tokens=max_tokens, block_size=Fixed(16), tree=False)
        assert tokens == plain_tokens[:max_tokens]
        widths |= {event.width for event in events}
    assert {2, 3} <= widths


def test_the_embedded_pair_with_a_dflash2_drafter_keeps_drafts_and_equals_torch(
        embedded_target_dir, tmp_path_factory):
    """The embedded drafter's trained layers with seeded DFlash 2 parts (rounds keep some drafts,
    reject others): MLX's output equals plain decoding and the Transformers engine's, round for
    round."""
    from dflash_local import paths
    from dflash_local.engines import engine_class_for

    sizes = {"conv_kernel_size": 4, "conv_group_size": 64, "selector_rank": 16, "selector_top_k": 4}
    drafter = tiny_models.dflash2_from_v1(paths.shipped_models_dir() / "smollm2-135m-dflash",
                                          tmp_path_factory.mktemp("embedded-dflash2-mlx"), sizes)
    mlx_engine = engine_class_for("mlx")(embedded_target_dir, drafter)
    torch_engine = engine_class_for("transformers")(embedded_target_dir, drafter)
    ids = mlx_engine.encode_chat([{"role": "user", "content": "Explain recursion briefly."}])

    def run(engine, **fields):
        events = list(engine.stream(ids, GenerationParams(max_tokens=24, **fields)))
        return [t for e in events for t in e.token_ids], [len(e.token_ids) for e in events]

    plain, _ = run(mlx_engine, speculative=False)
    tokens, rounds = run(mlx_engine, block_size=Fixed(4), tree=False)
    assert tokens == plain and 1 < max(rounds) and min(rounds[1:]) < 4  # kept some, not all
    assert (tokens, rounds) == run(torch_engine, block_size=Fixed(4), tree=False)
    mlx_engine.close()
    torch_engine.close()


def test_sampling_with_the_shipped_dflash2_drafter_keeps_the_targets_distribution(embedded_target_dir):
    """The shipped DFlash 2 drafter on MLX: the first MEASURED tokens of 300 seeded runs against
    their exact joint under plain sampling (test_sampling.py's check; the target's probabilities
    from the Transformers engine, the same float32 weights), drafts kept along the way."""
    from test_sampling import MEASURED, PASS_P_VALUE, chi_square_p_value, exact_joint

    from dflash_local import paths
    from dflash_local.engines import engine_class_for

    drafter = paths.shipped_models_dir() / "smollm2-135m-dflash"
    mlx_engine = engine_class_for("mlx")(embedded_target_dir, drafter)
    torch_engine = engine_class_for("transformers")(embedded_target_dir, None)
    ids = mlx_engine.encode_chat([{"role": "user", "content": "Name a colour."}])
    joint, _ = exact_joint(torch_engine, ids, GenerationParams(temperature=1.0, top_k=3))
    samples, kept = [], 0
    for seed in range(300):
        params = GenerationParams(temperature=1.0, top_k=3, block_size=Fixed(4), seed=seed,
                                  max_tokens=MEASURED + 1, stop_token_ids=(10_000,))
        events = list(mlx_engine.stream(ids, params))
        samples.append(tuple(t for e in events for t in e.token_ids)[:MEASURED])
        kept += sum(e.accepted for e in events)
    mlx_engine.close()
    torch_engine.close()
    assert kept > 0  # drafts were accepted: the rule was exercised, not only the bonus draw
    assert chi_square_p_value(samples, joint) > PASS_P_VALUE
