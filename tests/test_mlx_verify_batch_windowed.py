"""MLX's batched verify on a sliding-window target, and a forward that fails part-way.

A tiny Llama with windowed layers beside full ones (window 6, mlx-lm's own classes), runners at
contexts past the window: one batched forward over chains and plain steps gives each runner its
own verify's logits and leaves its state (each lane masked to its window layer by layer), round
after round; a tree among them is verified runner by runner. A forward that raises between two
layers leaves every runner's caches at its committed rows, windowed or not."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from mlx_tiny import CONFIGS, build_model
from test_mlx_verify_batch import CONTEXTS, _assert_same, _counting_runs, _runners

from dflash_local.engines import mlx_batch
from dflash_local.engines.mlx_adapters import adapter_for
from dflash_local.engines.mlx_engine import MLXTargetRunner
from dflash_local.method.draft_tree import DraftTree

WINDOW = CONFIGS["llama_sliding"]["sliding_window"]
CHAINS = [DraftTree.chain([77, 3, 3, 140, 200, 6]), DraftTree.chain([]), DraftTree.chain([4, 5]),
          DraftTree.chain([8, 9, 10, 11])]
KEPT = [[0, 1, 2], [0], [0, 1, 2], [0, 1]]


def _windowed():
    model, config = build_model("llama_sliding")
    return model, adapter_for(config["model_type"])


def test_a_windowed_target_batches_its_chains_as_each_runners_own(monkeypatch):
    model, adapter = _windowed()
    assert None in adapter.layer_windows(model) and WINDOW in adapter.layer_windows(model)
    own, batched = _runners(model, adapter, CONTEXTS), _runners(model, adapter, CONTEXTS)
    forwards = _counting_runs(monkeypatch, adapter)
    for round_index in range(3):
        anchors = [9 + round_index + lane for lane in range(len(CONTEXTS))]
        expected = [runner.verify(anchor, chain) for runner, anchor, chain in zip(own, anchors, CHAINS)]
        before = len(forwards)
        assert mlx_batch.batches(batched, CHAINS)
        _assert_same(MLXTargetRunner.verify_batch(batched, anchors, CHAINS), expected)
        assert len(forwards) == before + 1
        for own_runner, batched_runner, kept in zip(own, batched, KEPT, strict=True):
            np.testing.assert_allclose(np.array(batched_runner.commit(kept)),
                                       np.array(own_runner.commit(kept)), atol=2e-4)
            assert batched_runner.cache[0].offset == own_runner.cache[0].offset
    assert min(runner.cache[0].offset for runner in batched) > WINDOW


def test_a_tree_in_a_windowed_batch_is_verified_runner_by_runner(monkeypatch):
    model, adapter = _windowed()
    runners = _runners(model, adapter, CONTEXTS[:2])
    trees = [DraftTree((11, 12), (0, 0)), DraftTree.chain([4])]
    assert not mlx_batch.batches(runners, trees)
    forwards = _counting_runs(monkeypatch, adapter)
    MLXTargetRunner.verify_batch(runners, [1, 2], trees)
    assert len(forwards) == 2


class Failing:
    """A decoder layer that raises when run (the forward stops between two layers); what the
    adapter reads of it is the layer's own."""

    def __init__(self, layer):
        self.layer = layer

    def __call__(self, *args, **kwargs):
        raise RuntimeError("layer 2 failed")

    def __getattr__(self, name):
        return getattr(self.layer, name)


@pytest.mark.parametrize("family", ["qwen3", "llama_sliding"])
def test_a_forward_failing_between_layers_leaves_every_cache_whole(family):
    model, config = build_model(family)
    adapter = adapter_for(config["model_type"])
    own, batched = _runners(model, adapter, CONTEXTS), _runners(model, adapter, CONTEXTS)
    layers = adapter.text_model(model).layers
    layer = layers[2]
    layers[2] = Failing(layer)
    try:
        with pytest.raises(RuntimeError, match="layer 2 failed"):
            MLXTargetRunner.verify_batch(batched, [7] * 4, CHAINS)
    finally:
        layers[2] = layer
    for runner, rows in zip(batched, CONTEXTS, strict=True):
        assert [layer_cache.offset for layer_cache in runner.cache] == [rows] * len(runner.cache)
    expected = [runner.verify(7, chain) for runner, chain in zip(own, CHAINS)]
    _assert_same(MLXTargetRunner.verify_batch(batched, [7] * 4, CHAINS), expected)
    for own_runner, batched_runner, kept in zip(own, batched, KEPT, strict=True):
        np.testing.assert_allclose(np.array(batched_runner.commit(kept)),
                                   np.array(own_runner.commit(kept)), atol=2e-4)
