"""Tree drafts (draft_tree.py): building, masks and greedy walks on plain numbers; then each
engine's tree verify against its own fresh prefills (every node's logits are those of the path
to it, and a kept path leaves the cache as if only it had been run); then whole generations with
trees whose right path is never the first branch, token for token against plain decoding."""

from __future__ import annotations

import functools
import sys
from dataclasses import replace

import numpy as np
import pytest
from fixtures_tiny import ScriptedTreeDrafter, collect, follow, tiny_engine, tiny_pair

from dflash_local.drafter.model_torch import DraftSession
from dflash_local.events import GenerationParams, parse_block_size
from dflash_local.method.draft_tree import DraftTree, build_tree, tree_from_logits
from dflash_local.method.planning.costs import RoundCosts
from dflash_local.method.planning.trees import TreeSizer

PROMPT = [5, 17, 99, 42, 7, 250, 31, 8, 64, 120, 11, 9]
ANCHOR = 77
# node: 1 -> 3, 2 -> 140 (both under the anchor), 3 -> 200 under 1, 4 -> 6 under 2, 5 -> 9 under 4
TREE = DraftTree((3, 140, 200, 6, 9), (0, 0, 1, 2, 4))
PATHS = {0: [], 1: [3], 2: [140], 3: [3, 200], 4: [140, 6], 5: [140, 6, 9]}
NEVER = 10_000


def test_depths_mask_and_walk():
    assert TREE.depths == (0, 1, 1, 2, 2, 3) and TREE.depth == 3
    mask = TREE.ancestor_mask()
    for node, path in PATHS.items():
        expected = {0, node} | {n for n, p in PATHS.items() if p and p == path[: len(p)]}
        assert set(np.flatnonzero(mask[node])) == expected, node
    # the target's argmax after each row: it wants 140 after the anchor, then 6, then 9, then 55
    choice = np.array([140, 1, 6, 1, 9, 55])
    assert TREE.walk(choice) == ([2, 4, 5], 55)
    assert TREE.walk(np.array([8, 0, 0, 0, 0, 0])) == ([], 8)  # nothing kept: the bonus only
    assert TREE.walk(np.array([3, 12, 0, 0, 0, 0])) == ([1], 12)  # the first branch, then a miss


def test_build_tree_takes_the_most_probable_paths_best_first():
    probs = np.array([[0.6, 0.3, 0.1], [0.9, 0.05, 0.05], [0.5, 0.4, 0.1]])
    ids = np.array([[10, 11, 12], [20, 21, 22], [30, 31, 32]])
    tree = build_tree(ids, np.log(probs), nodes=5)
    # paths: 10 (.6), 10-20 (.54), 11 (.3), 10-20-30 (.27), 11-20 (.27) ...
    assert tree.token_ids == (10, 20, 11, 30, 20)
    assert tree.parents == (0, 1, 0, 2, 3)
    np.testing.assert_allclose(tree.path_probs, [0.6, 0.54, 0.3, 0.27, 0.27])
    assert all(parent < node for node, parent in enumerate(tree.parents, start=1))
    assert tree.prefix(3) == DraftTree((10, 20, 11), (0, 1, 0), tree.path_probs[:3])
    chain = build_tree(ids[:, :1], np.log(probs[:, :1]), nodes=3)
    assert chain.token_ids == (10, 20, 30) and chain.parents == (0, 1, 2)


def test_tree_from_logits_maps_draft_vocabulary_columns_to_ids():
    logits = np.array([[0.0, 5.0, 1.0], [3.0, 0.0, 2.5]])
    vocab_ids = np.array([7, 70, 700])
    tree = tree_from_logits(logits, vocab_ids, nodes=2, top_k=8)  # top_k beyond V' is cut
    assert tree.token_ids == (70, 7)
    assert tree.parents == (0, 1)
    first = np.exp(5.0) / np.exp(logits[0]).sum()
    np.testing.assert_allclose(tree.path_probs[0], first)
    assert tree_from_logits(logits, None, nodes=1).token_ids == (1,)


def test_tree_sizer_spends_rows_where_they_pay():
    # each row costs 15% of a plain step; the drafter pass 5%
    costs = RoundCosts(tuple(1.05 + 0.15 * w for w in range(16)), tuple(1.0 + 0.15 * w for w in range(16)))
    sizer = TreeSizer(costs)
    assert sizer.size([0.9, 0.8, 0.7, 0.6, 0.5], drafted_width=6) == 5  # likely hits pay their row
    assert sizer.size([0.9, 0.8, 0.05, 0.01], drafted_width=5) == 2  # unlikely ones do not
    assert sizer.size([0.01, 0.005], drafted_width=3) == 1  # the least a round verifies
    # a drafter that keeps far fewer drafts than it predicts is believed less
    for _ in range(10):
        sizer.observe([0.9, 0.8, 0.7], kept=0)
    assert sizer.scale < 0.2
    assert sizer.size([0.9, 0.8, 0.7, 0.6, 0.5], drafted_width=6) == 1
    for _ in range(40):
        sizer.observe([0.5, 0.4], kept=2)  # ... and more when it keeps more
    assert sizer.scale > 1.0


def test_a_lookup_chain_grafts_onto_the_nodes_that_hold_it_and_goes_on_in_new_ones():
    tree = DraftTree((5, 6, 7, 8), (0, 0, 1, 1), (0.5, 0.3, 0.2, 0.1))  # 5 -> {7, 8}; 6
    assert tree.held((5, 8, 9)) == (4, 2) and tree.held((9,)) == (0, 0)
    grafted = tree.graft((5, 8, 9, 10))
    assert grafted.token_ids == (5, 6, 7, 8, 9, 10)
    assert grafted.parents == (0, 0, 1, 1, 4, 5)  # under node 4 (5 -> 8), then a chain
    assert grafted.path_probs == (0.5, 0.3, 0.2, 0.1, 0.0, 0.0)  # not the drafter's proposals
    assert grafted.depths == (0, 1, 1, 2, 2, 3, 4)
    assert grafted.walk(np.array([5, 8, 9, 9, 9, 10, 11]))[0] == [1, 4, 5, 6]  # the whole copy kept
    assert tree.graft((5, 7)) is tree  # held already: nothing to add
    new_branch = tree.graft((9, 5))  # a first token the drafter never proposed: a new branch
    assert new_branch.parents[4:] == (0, 5) and new_branch.depth == 2
    # the drafter's chance of going on from a node to one of its children
    assert tree.children_mass(0) == pytest.approx(0.8)  # 0.5 + 0.3 from the anchor
    assert tree.children_mass(1) == pytest.approx(0.6)  # (0.2 + 0.1) / 0.5
    assert tree.children_mass(2) == 0.0 and DraftTree.chain([1, 2]).children_mass(0) == 0.0


def test_tree_sizer_grafts_a_lookup_chain_as_far_as_its_rows_pay():
    costs = RoundCosts(tuple(1.05 + 0.02 * w for w in range(16)), tuple(1.0 + 0.02 * w for w in range(16)))
    sizer = TreeSizer(costs)
    probs = [0.6, 0.3]  # two sized drafter nodes
    sure = [0.9 ** j for j in range(1, 9)]
    assert sizer.graft_length(probs, 16, sure, shared=0) == 8  # a likely copy: every token
    assert sizer.graft_length([0.6, 0.3, 0.2, 0.1], 16, sure, shared=3) == 8  # held ones cost no row
    assert sizer.graft_length(probs, 16, [0.01] * 8, shared=0) == 0  # a hopeless one: none
    assert sizer.graft_length(probs, 16, [0.01] * 8, shared=2) == 2  # only what is held anyway
    assert sizer.graft_length([0.5] * 14, 16, sure, shared=0) == 1  # rows end at the calibrated 15
    assert sizer.graft_length([0.5] * 15, 16, sure, shared=0) == 0
    # where the drafter's own children already hold most of the chance, a copy's other token
    # is unlikely whatever its estimate: fewer rows for it
    cheap_copy = [0.5 ** j for j in range(1, 9)]
    assert sizer.graft_length(probs, 16, cheap_copy, shared=0, taken=0.95) < sizer.graft_length(
        probs, 16, cheap_copy, shared=0)
    assert sizer.graft_length(probs, 16, sure, shared=0, taken=1.0) == 0
    dear = TreeSizer(RoundCosts(tuple(1.05 + 0.5 * w for w in range(16)), tuple(1.0 + 0.5 * w for w in range(16))))
    fading = [0.5 ** j for j in range(1, 9)]
    assert 0 < dear.graft_length(probs, 16, fading, shared=0) < sizer.graft_length(probs, 16, fading, shared=0)


def _torch_runner(tmp_path_factory, family):
    return tiny_engine(tiny_pair(tmp_path_factory, family)).make_runner(collect_taps=True)


@functools.cache
def _mlx_model(family):
    """One model per family: a fresh runner must run the same weights (MoE inits are unseeded)."""
    from mlx_tiny import build_model

    return build_model(family)


def _mlx_runner(family):
    pytest.importorskip("mlx_lm")
    from dflash_local.engines.mlx_adapters import adapter_for
    from dflash_local.engines.mlx_engine import MLXTargetRunner

    model, config = _mlx_model(family)
    return MLXTargetRunner(model, adapter_for(config["model_type"]), (1, 2), max_context=1024)


RUNNERS = [("torch", "qwen3"), ("torch", "llama"), ("torch-eager", "llama"), ("mlx", "qwen3"),
           ("mlx", "llama"), ("mlx", "qwen3_moe")]


@functools.cache
def _eager_model(target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target, attn_implementation="eager").eval()


def _eager_runner(tmp_path_factory, family):
    """Eager attention adds the mask to the scores: a boolean mask would be silently wrong."""
    from dflash_local.engines.torch_engine import TapCollector, TorchTargetRunner

    model = _eager_model(tiny_pair(tmp_path_factory, family).target)
    return TorchTargetRunner(model, TapCollector(model, (1, 2)), max_context=1024)


def _runner(kind, family, tmp_path_factory):
    if kind == "torch-eager":
        return _eager_runner(tmp_path_factory, family)
    return _torch_runner(tmp_path_factory, family) if kind == "torch" else _mlx_runner(family)


def _check_nodes_score_as_their_paths(make_runner):
    """A tree verify's logits at each node equal a fresh runner's chain verify of its path."""
    runner = make_runner()
    assert runner.supports_tree
    runner.prefill(PROMPT)
    logits = runner.verify_tree(ANCHOR, TREE)
    assert logits.shape[0] == len(TREE.token_ids) + 1
    for node, path in PATHS.items():
        fresh = make_runner()
        fresh.prefill(PROMPT)
        expected = fresh.verify_chain([ANCHOR, *path])[-1]
        np.testing.assert_allclose(logits[node], expected, atol=1e-4, rtol=1e-4, err_msg=str(node))


@pytest.mark.parametrize(("kind", "family"), RUNNERS)
def test_tree_verify_scores_every_node_as_its_own_path(kind, family, tmp_path_factory):
    _check_nodes_score_as_their_paths(lambda: _runner(kind, family, tmp_path_factory))


@pytest.mark.parametrize(("kind", "family"), RUNNERS)
@pytest.mark.parametrize("node", [0, 3, 5])
def test_kept_path_leaves_the_cache_of_a_fresh_prefill(kind, family, node, tmp_path_factory):
    runner = _runner(kind, family, tmp_path_factory)
    runner.prefill(PROMPT)
    runner.verify_tree(ANCHOR, TREE)
    rows = [0] + [n for n in sorted(PATHS) if n and PATHS[n] == PATHS[node][: len(PATHS[n])]]
    taps = runner.commit(rows)
    kept = [ANCHOR, *PATHS[node]]
    fresh = _runner(kind, family, tmp_path_factory)
    _, fresh_taps = fresh.prefill(PROMPT + kept)
    np.testing.assert_allclose(np.array(taps), np.array(fresh_taps[:, len(PROMPT):]), atol=1e-4)
    follow_up = [12, 13, 14]
    np.testing.assert_allclose(runner.verify_chain(follow_up), fresh.verify_chain(follow_up), atol=1e-4)


def test_mlx_tree_verify_changes_no_module_of_the_shared_model(monkeypatch):
    """The rows' positions reach the RoPEs installed at load through the run's cache views."""
    runner = _mlx_runner("qwen3")
    from dflash_local.accel.mlx_rope import CacheAtPositions

    layers = runner.adapter.text_model(runner.model).layers
    ropes = [layer.self_attn.rope for layer in layers]
    seen = []
    real_run = type(runner.adapter).run

    def recording_run(adapter, model, token_ids, cache, *args, **kwargs):
        seen.append([type(layer_cache) for layer_cache in cache])
        assert all(layer.self_attn.rope is rope for layer, rope in zip(layers, ropes, strict=True))
        return real_run(adapter, model, token_ids, cache, *args, **kwargs)

    # on the class: patched on the shared adapter instance, the undo would leave it a bound
    # method of its own that later class-level patches cannot reach
    monkeypatch.setattr(type(runner.adapter), "run", recording_run)
    runner.prefill(PROMPT)
    runner.verify_tree(ANCHOR, TREE)
    assert seen[-1] == [CacheAtPositions] * len(layers)
    assert all(layer.self_attn.rope is rope for layer, rope in zip(layers, ropes, strict=True))


@pytest.mark.parametrize("attention", ["ours", "mlx-lm's"])
def test_mlx_trees_score_as_their_paths_with_either_attention(attention, monkeypatch):
    """The tree's one-sequence pass with a boolean mask, through mlx_attention's kernel (what
    the engine runs on a CPU) and through mlx-lm's stock one."""
    pytest.importorskip("mlx_lm")
    from mlx_lm.models import base

    from dflash_local.accel.mlx_attention import NAME, cpu_attention

    module = sys.modules[type(_mlx_model("llama")[0]).__module__]
    monkeypatch.setattr(module, NAME, cpu_attention if attention == "ours" else base.scaled_dot_product_attention)
    _check_nodes_score_as_their_paths(lambda: _mlx_runner("llama"))


def test_mlx_trees_place_rows_through_scaled_ropes_and_refuse_the_dynamic_one():
    pytest.importorskip("mlx_lm")
    from mlx_tiny import build_model

    from dflash_local.engines.mlx_adapters import adapter_for
    from dflash_local.engines.mlx_engine import MLXTargetRunner

    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    model, _ = build_model("llama", rope_scaling=llama3)
    adapter = adapter_for("llama")
    _check_nodes_score_as_their_paths(lambda: MLXTargetRunner(model, adapter, (1, 2), max_context=1024))
    dynamic, _ = build_model("llama", rope_scaling={"type": "dynamic", "factor": 2.0})
    assert not MLXTargetRunner(dynamic, adapter, (1, 2), max_context=1024).supports_tree


def test_trees_only_where_one_mask_fits_every_layer():
    pytest.importorskip("mlx_lm")
    for family, expected in [("llama_sliding", False), ("qwen3_5", False), ("gemma3_text", False),
                             ("gemma4_text", False)]:
        assert _mlx_runner(family).supports_tree is expected, family
    from transformers import LlamaConfig, Qwen3Config

    from dflash_local.engines.torch_engine import supports_tree

    assert supports_tree(LlamaConfig())
    assert supports_tree(Qwen3Config())  # sliding_window is set but no layer uses it
    assert not supports_tree(Qwen3Config(use_sliding_window=True, max_window_layers=1))
    flash = LlamaConfig()
    flash._attn_implementation_internal = "flash_attention_2"  # no CUDA here: set, not loaded
    assert flash._attn_implementation == "flash_attention_2" and not supports_tree(flash)


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def engine(request, tmp_path_factory):
    return tiny_engine(tiny_pair(tmp_path_factory, request.param))


@pytest.mark.parametrize(("right", "block_size"), [(None, 8), (2, 8), (0, 4), (5, 16)])
def test_scripted_trees_keep_the_right_branch_and_equal_plain(engine, monkeypatch, right, block_size):
    prompt_ids = engine.encode_chat([{"role": "user", "content": "Once upon a time, in a"}])
    plain, _ = collect(engine.stream(prompt_ids, GenerationParams(
        max_tokens=24, stop_token_ids=(NEVER,), speculative=False)))
    drafters = []

    def make_drafter(window=None):
        inner = DraftSession(engine.drafter, window=window)
        drafters.append(ScriptedTreeDrafter(prompt_ids, follow(plain, len(prompt_ids), right=right),
                                            chain=block_size - 2, inner=inner))
        return drafters[-1]

    monkeypatch.setattr(engine, "make_drafter", make_drafter)
    tokens, events = collect(engine.stream(prompt_ids, GenerationParams(
        max_tokens=24, stop_token_ids=(NEVER,), block_size=parse_block_size(block_size))))
    assert tokens == plain
    full = [event for event in events[1:] if event.width == block_size]
    assert len(full) >= 2
    keep = block_size - 2 if right is None else min(right, block_size - 2)
    assert all(event.drafted == block_size - 1 for event in full)
    assert [event.accepted for event in full] == [keep] * len(full)
    assert all(event.draft_depth == block_size - 2 for event in full)
    chains, chain_events = collect(engine.stream(prompt_ids, GenerationParams(
        max_tokens=24, stop_token_ids=(NEVER,), block_size=parse_block_size(block_size), tree=False)))
    assert chains == plain
    assert all(event.draft_depth == event.drafted for event in chain_events[1:])  # chains only


def test_sampling_verifies_trees_unless_asked_for_chains(engine):
    prompt_ids = engine.encode_chat([{"role": "user", "content": "hello world"}])
    sampled = GenerationParams(max_tokens=16, temperature=0.8, seed=3, block_size=parse_block_size(8), stop_token_ids=(NEVER,))
    _, events = collect(engine.stream(prompt_ids, sampled))
    assert any(event.draft_depth < event.drafted for event in events[1:])
    _, chains = collect(engine.stream(prompt_ids, replace(sampled, tree=False)))
    assert all(event.draft_depth == event.drafted == event.width - 1 for event in chains[1:])
