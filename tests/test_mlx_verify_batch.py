"""MLX's batched verify (engines/mlx_batch.py) is each runner's own verify: runners at different
contexts verifying chains, trees of different widths and plain steps in one forward get the
logits their own verify gives and the state it leaves (the next round agrees after commit); whole
greedy generations whose verifies are batched round by round equal each generation alone;
targets that cannot batch are verified runner by runner.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from mlx_lm.utils import load_model
from mlx_tiny import build_model, write_target
from test_lossless_mlx import ScriptedDrafter, _drafter_for

from dflash_local.accel import mlx_attention, uninstall_all
from dflash_local.engines import mlx_batch
from dflash_local.engines.mlx_adapters import adapter_for
from dflash_local.engines.mlx_engine import MLXEngine, MLXTargetRunner
from dflash_local.events import Fixed, GenerationParams
from dflash_local.method.draft_tree import DraftTree
from dflash_local.method.speculative import generate

TAPS = (1, 3)
# float32 sums of another shape (a matmul over more rows): SmolLM2's logits (~20) move ~6e-5
ATOL = 2e-4
CONTEXTS = [9, 31, 17, 4]  # prompt rows of each runner
# a chain, a plain step (the empty tree), a tree with two branches, a wide flat tree
TREES = [DraftTree.chain([77, 3, 3, 140, 200, 6]), DraftTree.chain([]),
         DraftTree((11, 12, 13, 14, 15), (0, 0, 1, 2, 3)), DraftTree((21, 22, 23, 24), (0, 0, 0, 0))]
# what each runner keeps: part of the chain, the anchor, a path off the first branch, one leaf
KEPT = [[0, 1, 2, 3], [0], [0, 2, 4], [0, 3]]
FOLLOW_UP = [DraftTree.chain([5, 6]), DraftTree.chain([7, 8, 9]), DraftTree.chain([]),
             DraftTree((1, 2, 3), (0, 0, 1))]


def _runners(model, adapter, contexts, taps=TAPS):
    runners = []
    for index, rows in enumerate(contexts):
        runner = MLXTargetRunner(model, adapter, taps, max_context=1024)
        runner.prefill([(7 * index + 3 * row) % 250 + 4 for row in range(rows)])
        runners.append(runner)
    return runners


def _counting_runs(monkeypatch, adapter) -> list:
    """The adapter's forwards, counted: a batch must be one."""
    calls, real = [], type(adapter).run
    monkeypatch.setattr(type(adapter), "run", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    return calls


def _assert_same(batched, own):
    for got, expected in zip(batched, own, strict=True):
        assert got.shape == expected.shape
        np.testing.assert_array_equal(got.argmax(-1), expected.argmax(-1))
        np.testing.assert_allclose(got, expected, atol=ATOL)


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe"])
def test_a_batched_verify_is_each_runners_own(family, monkeypatch):
    model, config = build_model(family)
    adapter = adapter_for(config["model_type"])
    own, batched = _runners(model, adapter, CONTEXTS), _runners(model, adapter, CONTEXTS)
    anchors = [9, 10, 11, 12]
    expected = [runner.verify(anchor, tree) for runner, anchor, tree in zip(own, anchors, TREES)]
    forwards = _counting_runs(monkeypatch, adapter)
    assert mlx_batch.batches(batched)
    _assert_same(MLXTargetRunner.verify_batch(batched, anchors, TREES), expected)
    assert len(forwards) == 1
    for own_runner, batched_runner, kept in zip(own, batched, KEPT, strict=True):
        np.testing.assert_allclose(np.array(batched_runner.commit(kept)),
                                   np.array(own_runner.commit(kept)), atol=ATOL)
        assert batched_runner.cache[0].offset == own_runner.cache[0].offset
    _assert_same(MLXTargetRunner.verify_batch(batched, anchors, FOLLOW_UP),
                 [runner.verify(anchor, tree) for runner, anchor, tree in zip(own, anchors, FOLLOW_UP)])


def test_runners_without_taps_batch_beside_runners_with_them():
    model, config = build_model("qwen3")
    adapter = adapter_for(config["model_type"])
    plain, tapped = _runners(model, adapter, [5], taps=None)[0], _runners(model, adapter, [8])[0]
    MLXTargetRunner.verify_batch([plain, tapped], [1, 2], TREES[:2])
    assert plain.commit([0]) is None and tapped.commit([0]).shape == (1, 1, 2 * 64)


@pytest.mark.parametrize("family", ["qwen3_5", "gpt_oss", "gemma3_text"])
def test_a_target_that_cannot_batch_is_verified_runner_by_runner(family, monkeypatch):
    """Hybrid targets and sliding-window ones whose adapter declares no layer windows (gpt-oss,
    Gemma 3): chains and plain steps, each its own forward."""
    model, config = build_model(family)
    adapter = adapter_for(config["model_type"])
    chains = [TREES[0], TREES[1], DraftTree.chain([4, 5])]
    own, batched = _runners(model, adapter, CONTEXTS[:3]), _runners(model, adapter, CONTEXTS[:3])
    expected = [runner.verify(5, tree) for runner, tree in zip(own, chains)]
    forwards = _counting_runs(monkeypatch, adapter)
    assert not mlx_batch.batches(batched)
    _assert_same(MLXTargetRunner.verify_batch(batched, [5] * 3, chains), expected)
    assert len(forwards) == 3
    for own_runner, batched_runner, kept in zip(own, batched, [[0, 1, 2], [0], [0, 1]]):
        own_runner.commit(kept)
        batched_runner.commit(kept)
    follow_up = [DraftTree.chain([8, 9])] * 3
    _assert_same(MLXTargetRunner.verify_batch(batched, [6] * 3, follow_up),
                 [runner.verify(6, tree) for runner, tree in zip(own, follow_up)])


def test_runners_of_two_models_are_refused():
    first, config = build_model("qwen3")
    second, _ = build_model("qwen3", seed=1)
    adapter = adapter_for(config["model_type"])
    runners = _runners(first, adapter, [4]) + _runners(second, adapter, [4])
    with pytest.raises(ValueError, match="runners of one model, got 2 models"):
        MLXTargetRunner.verify_batch(runners, [1, 1], TREES[:2])
    with pytest.raises(ValueError, match="2 runners, 1 anchors, 2 trees"):
        MLXTargetRunner.verify_batch(runners, [1], TREES[:2])


def test_the_embedded_target_batches(embedded_target_dir):
    """SmolLM2 with the accelerations the engine installs (the engine's load is in the
    generation test: here its tokenizer and thread probe would only cost time)."""
    model, config = load_model(embedded_target_dir)
    adapter = adapter_for(config["model_type"])
    installed = [mlx_attention.install(model), adapter.install_row_rope(model)]
    try:
        own, batched = (_runners(model, adapter, [40, 13, 70], taps=(2, 20)) for _ in range(2))
        trees = [TREES[2], TREES[0], TREES[1]]
        expected = [runner.verify(50, tree) for runner, tree in zip(own, trees)]
        assert mlx_batch.batches(batched)
        _assert_same(MLXTargetRunner.verify_batch(batched, [50] * 3, trees), expected)
        for own_runner, batched_runner, kept in zip(own, batched, [[0, 2, 4], [0, 1], [0]]):
            np.testing.assert_allclose(np.array(batched_runner.commit(kept)),
                                       np.array(own_runner.commit(kept)), atol=ATOL)
        follow_up = [DraftTree.chain([1, 2, 3])] * 3
        _assert_same(MLXTargetRunner.verify_batch(batched, [60] * 3, follow_up),
                     [runner.verify(60, tree) for runner, tree in zip(own, follow_up)])
    finally:
        uninstall_all(installed)

class LockstepVerifies:
    """Test-only batcher: generations on threads, one running at a time (the baton); when every
    running generation has handed in its verify, one `verify_batch` answers them all."""

    def __init__(self, generations: int):
        self.baton = threading.Condition()
        self.running = generations
        self.pending: dict = {}  # runner -> (anchor, tree)
        self.answers: dict = {}  # runner -> logits
        self.batch_sizes: list[int] = []

    def verify(self, runner, anchor_id, tree):
        self.pending[runner] = (anchor_id, tree)
        self._run_when_all_in()
        while runner not in self.answers:
            self.baton.wait()
        return self.answers.pop(runner)

    def leave(self):
        self.running -= 1
        self._run_when_all_in()

    def _run_when_all_in(self):
        if not self.pending or len(self.pending) < self.running:
            return
        runners, self.pending = list(self.pending.items()), {}
        self.batch_sizes.append(len(runners))
        logits = MLXTargetRunner.verify_batch([runner for runner, _ in runners],
                                              *zip(*(request for _, request in runners)))
        self.answers.update(zip((runner for runner, _ in runners), logits))
        self.baton.notify_all()


class BatchedRunner:
    """A runner whose verify goes through the lockstep batcher; the rest is the runner's own."""

    def __init__(self, runner, lockstep: LockstepVerifies):
        self.runner, self.lockstep = runner, lockstep

    def verify(self, anchor_id, tree):
        return self.lockstep.verify(self.runner, anchor_id, tree)

    def __getattr__(self, name):
        return getattr(self.runner, name)


# (prompt, block size, tree drafts, a scripted drafter right for part of each block, max tokens)
GENERATIONS = [([1, 40, 71, 88, 101, 33, 72], 1, False, False, 14),
               ([5, 17, 99, 42, 7, 250, 31, 8, 64, 120, 11, 9, 3, 3, 40, 71], 4, False, True, 30),
               ([12, 250, 5, 64, 9], 6, True, False, 22)]


def _generate(engine, runner, prompt, block, tree, scripted, max_tokens, reference=None):
    params = GenerationParams(max_tokens=max_tokens, block_size=Fixed(block), tree=tree,
                              stop_token_ids=(-1,))
    drafter = engine.make_drafter()
    if scripted:
        drafter = ScriptedDrafter(drafter, reference)
    return [token for event in generate(runner, drafter, prompt, params) for token in event.token_ids]


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_generations_batched_round_by_round_equal_each_alone(family, tmp_path):
    target = write_target(tmp_path / "target", family, seed=3)
    engine = MLXEngine(target, _drafter_for(tmp_path, target))
    plain = [_generate(engine, engine.make_runner(True), prompt, 1, False, False, tokens)
             for prompt, _, _, _, tokens in GENERATIONS]
    alone = [_generate(engine, engine.make_runner(True), *spec, reference=reference)
             for spec, reference in zip(GENERATIONS, plain)]
    assert alone == plain
    lockstep, together = LockstepVerifies(len(GENERATIONS)), {}

    def lane(index):
        with lockstep.baton:
            try:
                runner = BatchedRunner(engine.make_runner(True), lockstep)
                together[index] = _generate(engine, runner, *GENERATIONS[index], reference=plain[index])
            finally:
                lockstep.leave()

    threads = [threading.Thread(target=lane, args=(index,)) for index in range(len(GENERATIONS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert [together.get(index) for index in range(len(GENERATIONS))] == alone
    assert max(lockstep.batch_sizes) == len(GENERATIONS)  # the rounds really ran together
    engine.close()
