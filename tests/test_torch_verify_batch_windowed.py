"""Sliding-window targets in the ragged verify, and a forward that fails part-way.

Tiny Mistral (every layer windowed), Qwen3 and Gemma 3 (windowed layers beside full ones)
targets built from the real Transformers classes, a window of 6 rows shorter than every context
here: one `verify_batch` over chains and plain steps gives each runner its own verify's logits
and taps (each runner's own window mask), and greedy generations driven round by round through
it reproduce plain decoding token for token. A forward that raises between two layers leaves
every runner's cache at its committed rows, so the next batch verifies as if it never ran."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from arch_tiny import WINDOW, drafter_for, hf_target
from fixtures_tiny import collect, params_of
from test_torch_verify_batch import PROMPTS, assert_logits_match, prefilled

from dflash_local.engines import torch_batch
from dflash_local.engines.torch_engine import TorchEngine, TorchTargetRunner, decoder_layers
from dflash_local.method.draft_tree import DraftTree

CHAINS = [DraftTree.chain([77, 3, 3, 140, 200, 6, 9, 9]), DraftTree((), ()),
          DraftTree.chain([40, 41]), DraftTree.chain([5, 6, 7, 8])]
KEPT = [[0, 1, 2], [0], [0, 1, 2], [0, 1, 2, 3, 4]]


@pytest.fixture(scope="module", params=["mistral", "qwen3_windowed", "gemma3_text"])
def engine(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"{request.param}-windowed")
    target = hf_target(root / "target", request.param, seed=3)
    return TorchEngine(target, drafter_for(root / "drafter", target))


def test_windowed_runners_end_as_their_own_verify_leaves_them(engine):
    assert torch_batch.can_batch(engine.make_runner(collect_taps=False))
    alone, batched = prefilled(engine, PROMPTS), prefilled(engine, PROMPTS)
    for round_index in range(3):  # contexts move past the window round by round
        anchors = [21 + round_index] * len(PROMPTS)
        expected = [runner.verify(anchor, chain) for runner, anchor, chain in zip(alone, anchors, CHAINS)]
        got = TorchTargetRunner.verify_batch(batched, anchors, CHAINS)
        for logits, logits_batched in zip(expected, got):
            assert_logits_match(logits, logits_batched)
        for runner, runner_batched, rows in zip(alone, batched, KEPT):
            torch.testing.assert_close(runner_batched.commit(rows), runner.commit(rows),
                                       atol=2e-4, rtol=1e-4)
            assert runner_batched.cache.get_seq_length() == runner.cache.get_seq_length()
    assert min(runner.context_rows for runner in batched) >= 2 * WINDOW


def test_windowed_lockstep_greedy_equals_each_alone(engine):
    """Chains right for a few tokens then wrong, and plain steps, as one batch a round."""
    prompts = PROMPTS[:3]
    reference = [collect(engine.stream(prompt, params_of(max_tokens=20, speculative=False)))[0]
                 for prompt in prompts]
    runners = [engine.make_runner(collect_taps=True) for _ in prompts]
    outputs = [[int(runner.prefill(prompt)[0].argmax())] for runner, prompt in zip(runners, prompts)]
    round_index = 0
    while active := [lane for lane, out in enumerate(outputs) if len(out) < len(reference[lane])]:
        round_index += 1
        truths = [(reference[lane] + [0] * 8)[len(outputs[lane]):] for lane in active]
        right = [(round_index + lane) % 4 for lane in active]
        chains = [DraftTree.chain(truth[:k] + [(truth[k] + 1) % 256]) if k else DraftTree((), ())
                  for truth, k in zip(truths, right)]
        logits = TorchTargetRunner.verify_batch([runners[lane] for lane in active],
                                                [outputs[lane][-1] for lane in active], chains)
        for lane, chain, lane_logits in zip(active, chains, logits):
            path, bonus = chain.walk(lane_logits.argmax(-1))
            runners[lane].commit([0, *path])
            outputs[lane] += [chain.token_ids[node - 1] for node in path] + [bonus]
    assert [out[: len(ref)] for out, ref in zip(outputs, reference)] == reference


def test_a_tree_in_a_windowed_batch_is_verified_one_by_one(engine, monkeypatch):
    runners = prefilled(engine, PROMPTS[:2])
    monkeypatch.setattr(torch_batch, "_ragged_verify", None)  # any ragged forward would fail
    trees = [DraftTree((11, 12), (0, 0)), DraftTree.chain([4])]
    logits = TorchTargetRunner.verify_batch(runners, [1, 2], trees)
    assert [rows.shape[0] for rows in logits] == [3, 2]


class Failing(RuntimeError):
    pass


def test_a_forward_failing_between_layers_leaves_every_cache_whole(engine):
    alone, batched = prefilled(engine, PROMPTS), prefilled(engine, PROMPTS)
    committed = [runner.context_rows for runner in batched]

    def fail(_module, _inputs):
        raise Failing("layer 2 failed")

    handle = decoder_layers(engine.model)[2].register_forward_pre_hook(fail)
    try:
        with pytest.raises(Failing):
            TorchTargetRunner.verify_batch(batched, [7] * 4, CHAINS)
    finally:
        handle.remove()
    for runner, rows in zip(batched, committed):
        assert [layer.get_seq_length() for layer in runner.cache.layers] == (
            [rows] * len(runner.cache.layers))
    expected = [runner.verify(7, chain) for runner, chain in zip(alone, CHAINS)]
    got = TorchTargetRunner.verify_batch(batched, [7] * 4, CHAINS)
    for logits, logits_batched in zip(expected, got):
        assert_logits_match(logits, logits_batched)
    for runner, runner_batched, rows in zip(alone, batched, KEPT):
        np.testing.assert_allclose(runner_batched.commit(rows).numpy(), runner.commit(rows).numpy(),
                                   atol=2e-4, rtol=1e-4)
