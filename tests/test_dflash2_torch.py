"""DFlash 2 drafters in PyTorch against z-lab's `DFlash2DraftModel` and its reference loop, and
lossless through the real engine (greedy token for token, sampling by a chi-square test)."""

from __future__ import annotations

import time

import pytest
import tiny_models
import torch
import torch.nn.functional as F
from fixtures_tiny import collect, params_of, tiny_pair
from test_sampling import MEASURED, PASS_P_VALUE, chi_square_p_value, exact_joint
from transformers import AutoModelForCausalLM

from dflash_local import paths
from dflash_local.drafter.dflash2_torch import grouped_causal_conv
from dflash_local.drafter.model_torch import DraftSession, load_drafter

zlab = pytest.importorskip("dflash.model")  # test-only oracle

MASK = tiny_models.MASK_ID
PROMPT = [1, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 2, 1, 97]
NEVER = 10_000  # a stop token no run emits: every run goes to max_tokens


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory, "qwen3", block_size=16, dflash2=tiny_models.DFLASH2)


@pytest.fixture(scope="module")
def models(pair):
    """(target, our bound drafter, z-lab's DFlash2DraftModel) on the same checkpoint."""
    target = AutoModelForCausalLM.from_pretrained(pair.target, dtype=torch.float32).eval()
    ours = load_drafter(pair.drafter).bind(target.get_input_embeddings(), target.get_output_embeddings())
    reference = zlab.DFlash2DraftModel.from_pretrained(pair.drafter, dtype=torch.float32).eval()
    return target, ours, reference


def taps_of(target, ids, layer_ids):
    with torch.inference_mode():
        out = target(torch.tensor([ids]), output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)


def reference_hidden(target, reference, taps, block, positions, cache):
    with torch.inference_mode():
        noise = F.embedding(block, target.get_input_embeddings().weight)
        return reference(position_ids=positions[None], noise_embedding=noise, target_hidden=taps,
                         past_key_values=cache, use_cache=True)


@pytest.mark.parametrize("width", [16, 5, 4])
def test_hidden_states_and_greedy_drafts_equal_zlab_over_rounds(models, width):
    """Round 1 drafts from the prompt's taps, round 2 from three accepted rows; each round's
    hidden states and the selector's greedy drafts as z-lab's."""
    target, ours, reference = models
    taps = taps_of(target, PROMPT + [50, 60, 70], ours.config.target_layer_ids)
    session, ref_cache = DraftSession(ours), zlab._make_cache(reference.config)
    for start, end, anchor in [(0, len(PROMPT), PROMPT[-1]), (len(PROMPT), len(PROMPT) + 3, 70)]:
        block = torch.tensor([[anchor] + [MASK] * (width - 1)])
        expected = reference_hidden(target, reference, taps[:, start:end], block,
                                    torch.arange(start, end + width), ref_cache)
        zlab._crop_to(ref_cache, end)
        with torch.inference_mode():
            drafts, _, _ = reference.propose(expected[:, 1:], block[:, 0], target.lm_head, 0.0)
        ours_hidden = session._draft(anchor, taps[:, start:end], width)
        torch.testing.assert_close(ours_hidden, expected[:, 1:], rtol=1e-5, atol=1e-5)
        with torch.inference_mode():
            chain = session.model.candidate_selector.inputs(
                ours_hidden[0], session.model.draft_logits(ours_hidden)[0][0], None, anchor)
        from dflash_local.drafter.selector import greedy_chain
        assert greedy_chain(chain) == drafts[0].tolist()


@pytest.mark.parametrize("length", [1, 2, 3])
def test_the_convolution_takes_a_block_shorter_than_its_kernel(length):
    """A causal convolution's first rows depend on no later row: a short block's are the long
    block's first rows. (z-lab 0.1.0's own convolution fails below K - 1 rows: shown below.)"""
    torch.manual_seed(0)
    kernel, groups, group_size = 4, 4, 16
    hidden = torch.randn(1, 6, groups * group_size)
    dynamic = torch.randn(1, 6, kernel, groups)
    base = torch.randn(kernel, groups * group_size)
    whole = grouped_causal_conv(hidden, dynamic, base, group_size)
    short = grouped_causal_conv(hidden[:, :length], dynamic[:, :length], base, group_size)
    torch.testing.assert_close(short, whole[:, :length])
    reference = zlab._grouped_dynamic_convolve(hidden, dynamic[..., None], base, group_size)
    torch.testing.assert_close(whole, reference, rtol=1e-5, atol=1e-5)
    short_reference = lambda: zlab._grouped_dynamic_convolve(
        hidden[:, :length], dynamic[:, :length, :, :, None], base, group_size)
    if length < kernel - 1:  # its padding overshoots a block this short
        with pytest.raises(RuntimeError):
            short_reference()
    else:
        torch.testing.assert_close(short, short_reference(), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def embedded_dflash2(tmp_path_factory):
    """The embedded drafter's trained layers with DFlash 2 parts of the test's own seeded sizes
    (tiny_models.dflash2_from_v1): rounds keep drafts."""
    sizes = {"conv_kernel_size": 4, "conv_group_size": 64, "selector_rank": 16, "selector_top_k": 4}
    return tiny_models.dflash2_from_v1(paths.shipped_models_dir() / "smollm2-135m-dflash",
                                       tmp_path_factory.mktemp("embedded-dflash2"), sizes)


def test_decodes_as_zlabs_reference_loop_token_for_token_and_round_for_round(
        embedded_target_dir, embedded_dflash2, monkeypatch):
    """Greedy, block 16, chains (z-lab's loop verifies one chain a round), on the embedded
    target: the same tokens, and the same tokens per round in every round both run at the full
    block width."""
    from dflash_local.engines.torch_engine import TorchEngine

    target = AutoModelForCausalLM.from_pretrained(embedded_target_dir, dtype=torch.float32).eval()
    reference = zlab.DFlash2DraftModel.from_pretrained(embedded_dflash2, dtype=torch.float32).eval()
    monkeypatch.setattr(zlab, "_cuda_time", time.perf_counter)  # its stats time a GPU otherwise
    original = zlab._grouped_dynamic_convolve

    def short_blocks_too(hidden, dynamic, base, group_size):
        """z-lab's, but for the tail blocks under K - 1 rows, where it fails: ours there."""
        if hidden.shape[1] >= base.shape[0] - 1:
            return original(hidden, dynamic, base, group_size)
        return grouped_causal_conv(hidden, dynamic, base, group_size)

    monkeypatch.setattr(zlab, "_grouped_dynamic_convolve", short_blocks_too)
    engine = TorchEngine(embedded_target_dir, embedded_dflash2)
    prompt_ids = engine.encode_chat([{"role": "user", "content": "Write a Python function that "
                                      "returns the n-th Fibonacci number."}])
    max_tokens = 64
    with torch.inference_mode():
        expected = zlab.dflash_generate(reference, target, torch.tensor([prompt_ids]), max_tokens,
                                        None, block_size=16, return_stats=True)
    tokens, events = collect(engine.stream(prompt_ids, params_of(
        max_tokens=max_tokens, block_size=16, tree=False, stop_token_ids=(NEVER,))))
    assert tokens == expected.output_ids[0, len(prompt_ids):].tolist()
    ours = [len(event.token_ids) for event in events[1:]]
    full_rounds = [index for index, event in enumerate(events[1:]) if event.width == 16]
    assert len(full_rounds) >= 3 and any(ours[i] > 2 for i in full_rounds)  # drafts were kept
    assert [ours[i] for i in full_rounds] == expected.acceptance_lengths[: len(full_rounds)]


@pytest.fixture(scope="module")
def embedded_engine(embedded_target_dir, embedded_dflash2):
    from dflash_local.engines.torch_engine import TorchEngine

    return TorchEngine(embedded_target_dir, embedded_dflash2)


@pytest.mark.parametrize("block_size", [2, 3, 4, 16])
@pytest.mark.parametrize("tree", [True, False], ids=["trees", "chains"])
def test_speculative_equals_plain(embedded_engine, block_size, tree):
    """Blocks of 2 and 3 rows are shorter than the kernel (4): every round's are, and so is the
    tail of max_tokens at any block size."""
    ids = embedded_engine.encode_chat([{"role": "user", "content": "Explain recursion briefly."}])
    plain, _ = collect(embedded_engine.stream(ids, params_of(max_tokens=24, speculative=False)))
    tokens, events = collect(embedded_engine.stream(ids, params_of(
        max_tokens=24, block_size=block_size, tree=tree)))
    assert tokens == plain
    rounds = events[1:]
    assert any(e.accepted for e in rounds) and any(e.accepted < e.draft_depth for e in rounds)
    assert tree or all(event.draft_depth == event.drafted for event in events[1:])


def test_sampling_keeps_the_targets_distribution(embedded_engine):
    """The first MEASURED tokens of 300 seeded runs against their exact joint under plain
    sampling (test_sampling.py's check), drafts kept along the way."""
    ids = embedded_engine.encode_chat([{"role": "user", "content": "Name a colour."}])
    params = params_of(temperature=1.0, top_k=3, block_size=4)
    joint, _ = exact_joint(embedded_engine, ids, params)
    samples, kept = [], 0
    for seed in range(300):
        seeded = params_of(temperature=1.0, top_k=3, block_size=4, seed=seed, max_tokens=MEASURED + 1,
                           stop_token_ids=(NEVER,))
        tokens, events = collect(embedded_engine.stream(ids, seeded))
        samples.append(tuple(tokens[:MEASURED]))
        kept += sum(event.accepted for event in events)
    assert kept > 0  # drafts were accepted: the rule was exercised, not only the bonus draw
    assert chi_square_p_value(samples, joint) > PASS_P_VALUE
