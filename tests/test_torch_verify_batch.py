"""`TorchTargetRunner.verify_batch` leaves every runner as its own verify would: runners at
different context lengths, chains and trees of different widths and a plain step in one ragged
forward give each runner its own verify's logits (same argmax, rounding apart), the same taps on
commit and the same logits in the next round; greedy generations driven round by round through
it reproduce plain decoding token for token. Tiny Llama and Qwen3 targets built from the real
Transformers classes (Qwen3 with eager attention too), and the embedded SmolLM2; a
sliding-window target falls back."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from arch_tiny import drafter_for, hf_target
from fixtures_tiny import collect, params_of, tiny_engine, tiny_pair

from dflash_local import paths
from dflash_local.engines import torch_batch
from dflash_local.engines.torch_engine import TorchEngine, TorchTargetRunner
from dflash_local.method.draft_tree import DraftTree

CLOSE = {"atol": 2e-4, "rtol": 1e-4}
PROMPTS = [[5, 17, 99, 42, 7], [9, 250, 31, 8, 64, 120, 11, 9, 14, 15, 16, 30, 31, 32, 33, 34],
           [60, 61, 62], [70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87]]
TREES = [DraftTree.chain([77, 3, 3, 140, 200, 6]),  # a chain of width 7
         DraftTree((), ()),  # a plain step
         DraftTree((11, 12, 13, 14, 15), (0, 0, 1, 1, 2)),  # branches at the anchor and node 1
         DraftTree.chain([40, 41])]
KEPT = [[0, 1, 2, 3], [0], [0, 2, 5], [0, 1, 2]]  # a path of each; [0, 2, 5] moves its rows


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen3-eager", "embedded"])
def engine(request, tmp_path_factory):
    if request.param == "embedded":
        target = request.getfixturevalue("embedded_target_dir")
        return TorchEngine(target, paths.shipped_models_dir() / "smollm2-135m-dflash")
    if request.param == "qwen3-eager":  # masks added to the scores: the additive form
        pair = tiny_pair(tmp_path_factory, "qwen3")
        engine = TorchEngine(pair.target, pair.drafter)
        engine.model.set_attn_implementation("eager")
        return engine
    return tiny_engine(tiny_pair(tmp_path_factory, request.param))


def prefilled(engine, prompts) -> list[TorchTargetRunner]:
    runners = [engine.make_runner(collect_taps=True) for _ in prompts]
    for runner, prompt in zip(runners, prompts):
        runner.prefill(prompt)
    return runners


def assert_logits_match(alone: np.ndarray, batched: np.ndarray) -> None:
    assert alone.shape == batched.shape
    np.testing.assert_array_equal(alone.argmax(-1), batched.argmax(-1))
    torch.testing.assert_close(torch.from_numpy(batched), torch.from_numpy(alone), **CLOSE)


@pytest.mark.parametrize("count", [2, 4])
def test_each_runner_ends_as_its_own_verify_leaves_it(engine, count):
    assert torch_batch.can_batch(engine.make_runner(collect_taps=False))
    implementation = engine.model.config._attn_implementation
    alone, batched = prefilled(engine, PROMPTS[:count]), prefilled(engine, PROMPTS[:count])
    anchors = [21, 22, 23, 24][:count]
    expected = [runner.verify(anchor, tree) for runner, anchor, tree in zip(alone, anchors, TREES)]
    got = TorchTargetRunner.verify_batch(batched, anchors, TREES[:count])
    assert engine.model.config._attn_implementation == implementation  # its own attention back
    for logits, logits_batched in zip(expected, got):
        assert_logits_match(logits, logits_batched)
    for runner, runner_batched, rows in zip(alone, batched, KEPT):
        torch.testing.assert_close(runner_batched.commit(rows), runner.commit(rows), **CLOSE)
        assert runner_batched.cache.get_seq_length() == runner.cache.get_seq_length()
    follow_up = [DraftTree.chain([5, 6, 7]), DraftTree((8, 9), (0, 0)), DraftTree((), ()),
                 DraftTree.chain([1])][:count]
    expected = [runner.verify(3, tree) for runner, tree in zip(alone, follow_up)]
    got = TorchTargetRunner.verify_batch(batched, [3] * count, follow_up)
    for logits, logits_batched in zip(expected, got):
        assert_logits_match(logits, logits_batched)


def reference_draft(truth: list[int], lane: int, round_index: int, vocab: int) -> DraftTree:
    """A round's draft from the known output `truth` (from the token after the anchor): a chain
    right for its first k drafts, a plain step, or a tree whose right path is its second branch."""
    wrong = [(token + 1) % vocab for token in truth]
    kind = (lane + round_index) % 3
    if kind == 0:
        right = round_index % 4
        return DraftTree.chain(truth[:right] + wrong[right : right + 2])
    if kind == 1:
        return DraftTree((), ())
    return DraftTree((wrong[0], truth[0], truth[1], wrong[1]), (0, 0, 2, 1))


def lockstep_greedy(engine, prompts: list[list[int]], reference: list[list[int]]):
    """Greedy generations of len(reference[i]) tokens, each round's verifies as one verify_batch
    over the lanes still running (so the batch shrinks as lanes finish); and every kept path."""
    vocab = engine.model.config.vocab_size
    runners = [engine.make_runner(collect_taps=True) for _ in prompts]
    outputs = [[int(runner.prefill(prompt)[0].argmax())] for runner, prompt in zip(runners, prompts)]
    round_index, paths = 0, []
    while active := [lane for lane, out in enumerate(outputs) if len(out) < len(reference[lane])]:
        round_index += 1
        truths = [(reference[lane] + [0] * 8)[len(outputs[lane]):] for lane in active]
        trees = [reference_draft(truth, lane, round_index, vocab) for lane, truth in zip(active, truths)]
        logits = TorchTargetRunner.verify_batch([runners[lane] for lane in active],
                                                [outputs[lane][-1] for lane in active], trees)
        for lane, tree, lane_logits in zip(active, trees, logits):
            path, bonus = tree.walk(lane_logits.argmax(-1))
            taps = runners[lane].commit([0, *path])
            assert taps.shape[1] == len(path) + 1
            outputs[lane] += [tree.token_ids[node - 1] for node in path] + [bonus]
            paths.append(path)
    return [out[: len(ref)] for out, ref in zip(outputs, reference)], paths


def test_lockstep_greedy_generations_equal_each_alone(engine):
    prompts = PROMPTS[:3]
    reference = [collect(engine.stream(prompt, params_of(max_tokens=24, speculative=False)))[0]
                 for prompt in prompts]
    assert min(len(tokens) for tokens in reference) > 4
    outputs, paths = lockstep_greedy(engine, prompts, reference)
    assert outputs == reference
    assert [2, 3] in paths and [1, 2] in paths  # a tree's second branch kept; a whole chain


def test_a_sliding_window_target_verifies_one_by_one(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss-batch")
    target = hf_target(root / "target", "gpt_oss", seed=3)
    engine = TorchEngine(target, drafter_for(root / "drafter", target))
    alone, batched = prefilled(engine, PROMPTS[:3]), prefilled(engine, PROMPTS[:3])
    assert not torch_batch.can_batch(batched[0])  # no tree verify: chains and plain steps only
    chains = [DraftTree.chain([77, 3, 3]), DraftTree((), ()), DraftTree.chain([40])]
    expected = [runner.verify(9, chain) for runner, chain in zip(alone, chains)]
    got = TorchTargetRunner.verify_batch(batched, [9] * 3, chains)
    for logits, logits_batched in zip(expected, got):
        np.testing.assert_array_equal(logits, logits_batched)
    for runner, runner_batched, rows in zip(alone, batched, [[0, 1], [0], [0, 1]]):
        torch.testing.assert_close(runner_batched.commit(rows), runner.commit(rows))


def test_mismatched_arguments_are_refused(tmp_path_factory):
    engine = tiny_engine(tiny_pair(tmp_path_factory, "qwen3"))
    other = tiny_engine(tiny_pair(tmp_path_factory, "llama"))
    runners = [engine.make_runner(collect_taps=False), engine.make_runner(collect_taps=False)]
    with pytest.raises(ValueError, match="2 runners, 1 anchors, 2 trees"):
        TorchTargetRunner.verify_batch(runners, [1], TREES[:2])
    with pytest.raises(ValueError, match="runners of one model, got 2 models"):
        TorchTargetRunner.verify_batch([runners[0], other.make_runner(collect_taps=False)],
                                       [1, 1], TREES[:2])
