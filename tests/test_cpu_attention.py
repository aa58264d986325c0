"""Grouped-query attention kept grouped in CPU verify passes: the same logits as Transformers'
"sdpa" bit for bit, without its per-layer copies of the cache, and only where it applies."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers.integrations.sdpa_attention as sdpa_module

from dflash_local.accel import torch_attention
from dflash_local.accel.torch_attention import NAME
from dflash_local.method.draft_tree import DraftTree


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    import tiny_models

    return tiny_models.make_target(tmp_path_factory.mktemp("gqa") / "target", family="llama")


@pytest.fixture(scope="module")
def engine(target_dir):
    from dflash_local.engines.torch_engine import TorchEngine

    return TorchEngine(target_dir, None)


@pytest.fixture
def repeat_kv_calls(monkeypatch):
    calls = []
    original = sdpa_module.repeat_kv

    def counting(hidden, n_rep):
        calls.append(hidden.shape)
        return original(hidden, n_rep)

    monkeypatch.setattr(sdpa_module, "repeat_kv", counting)
    return calls


def _verify_both(engine, prompt: list[int], anchor: int, tree: DraftTree, chain: list[int]):
    runner = engine.make_runner(False)
    runner.prefill(prompt)
    tree_logits = runner.verify_tree(anchor, tree)
    runner.commit([0])
    return tree_logits, runner.verify_chain([anchor, *chain])


def test_the_cpu_engine_uses_it_and_still_verifies_trees(engine):
    assert engine.model.config._attn_implementation == NAME
    assert engine.make_runner(False).supports_tree


def test_verify_logits_equal_stock_sdpa_bit_for_bit_without_copying_the_cache(engine, repeat_kv_calls):
    prompt = list(range(20, 60))
    tree = DraftTree((30, 31, 32, 40, 41), (0, 1, 1, 0, 4))  # two branches, one of depth 2
    chain = [30, 31, 33, 34]
    ours = _verify_both(engine, prompt, 25, tree, chain)
    assert repeat_kv_calls == []  # the 5- and 6-row passes kept the KV heads grouped
    engine.model.set_attn_implementation("sdpa")
    try:
        stock = _verify_both(engine, prompt, 25, tree, chain)
    finally:
        engine.model.set_attn_implementation(NAME)
    layers = engine.model.config.num_hidden_layers
    assert len(repeat_kv_calls) == 2 * 2 * layers  # the control: keys and values, each layer, each pass
    for mine, theirs in zip(ours, stock):
        assert mine.shape == theirs.shape
        assert np.array_equal(mine, theirs)


def test_speculative_equals_plain_with_it(target_dir):
    import tiny_models
    from fixtures_tiny import params_of

    from dflash_local.engines.torch_engine import TorchEngine

    drafter = tiny_models.make_drafter(target_dir.parent / "drafter", target_dir, block_size=8)
    paired = TorchEngine(target_dir, drafter)
    assert paired.model.config._attn_implementation == NAME
    prompt_ids = paired.encode_chat([{"role": "user", "content": "def add(a, b):"}])

    def tokens(**params):
        events = paired.stream(prompt_ids, params_of(max_tokens=24, stop_token_ids=(10_000,), **params))
        return [t for event in events for t in event.token_ids]

    plain = tokens(speculative=False)
    for block_size in (2, 8):
        assert tokens(block_size=block_size, tree=True) == plain
        assert tokens(block_size=block_size, tree=False) == plain


def test_it_is_left_alone_where_it_does_not_apply(engine):
    engine.model.set_attn_implementation("eager")
    try:
        assert not torch_attention.install(engine.model)  # only a model loaded with sdpa switches
        assert engine.model.config._attn_implementation == "eager"
    finally:
        engine.model.set_attn_implementation(NAME)


@pytest.fixture
def grouped_kernel_calls(monkeypatch):
    """enable_gqa of every scaled_dot_product_attention call (ours and stock sdpa's)."""
    calls = []
    original = torch.nn.functional.scaled_dot_product_attention

    def spying(*args, **kwargs):
        calls.append(bool(kwargs.get("enable_gqa", False)))
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spying)
    return calls


class Grouped(torch.nn.Module):
    num_key_value_groups = 2
    is_causal = True


def test_masked_blocks_take_the_grouped_kernel_and_the_rest_goes_to_stock_sdpa(
        grouped_kernel_calls, repeat_kv_calls):
    """One-row steps, unmasked (causal) blocks and position biases: handled as "sdpa" does,
    which the grouped path alone would get wrong (no causality, no bias)."""
    from dflash_local.accel.torch_attention import cpu_gqa_sdpa_forward

    torch.manual_seed(0)
    key, value = torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    rows = torch.randn(1, 4, 9, 8)
    bias = torch.randn(1, 4, 9, 9)
    everything = torch.ones(1, 1, 9, 9, dtype=torch.bool)
    grouped, _ = cpu_gqa_sdpa_forward(Grouped(), rows, key, value, everything)
    assert grouped_kernel_calls == [True] and repeat_kv_calls == []
    for query, mask, extra in [(rows[:, :, :1], everything[:, :, :1], {}), (rows, None, {}),
                               (rows, everything, {"position_bias": bias})]:
        ours, _ = cpu_gqa_sdpa_forward(Grouped(), query, key, value, mask, **extra)
        stock, _ = sdpa_module.sdpa_attention_forward(Grouped(), query, key, value, mask, **extra)
        assert torch.equal(ours, stock)
    # the first three went through stock sdpa (each call above ran it once more, as the control)
    assert grouped_kernel_calls[1::2] == grouped_kernel_calls[2::2]
    assert not torch.allclose(grouped, ours)  # the control: the bias mattered
    causal, _ = cpu_gqa_sdpa_forward(Grouped(), rows, key, value, None)
    assert not torch.allclose(grouped, causal)  # the control: causality mattered
    with pytest.raises(ValueError, match="softcap"):  # as stock sdpa: refused, not ignored
        cpu_gqa_sdpa_forward(Grouped(), rows, key, value, everything, softcap=30.0)


def test_bfloat16_verify_logits_equal_stock_sdpa(target_dir):
    from dflash_local.engines.torch_engine import TorchEngine

    engine = TorchEngine(target_dir, None, dtype="bfloat16")
    assert engine.model.config._attn_implementation == NAME
    tree = DraftTree((30, 31, 32), (0, 1, 0))
    ours = _verify_both(engine, list(range(20, 50)), 25, tree, [30, 31])
    engine.model.set_attn_implementation("sdpa")
    stock = _verify_both(engine, list(range(20, 50)), 25, tree, [30, 31])
    for mine, theirs in zip(ours, stock):
        assert np.array_equal(mine, theirs)


def test_closing_the_engine_switches_back_and_the_last_unregisters_the_name(target_dir, monkeypatch):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from dflash_local.engines.torch_engine import TorchEngine

    registries = (AttentionInterface._global_mapping, AttentionMaskInterface._global_mapping)
    monkeypatch.setattr(torch_attention, "_registered", 0)  # as in a fresh process
    for registry in registries:
        monkeypatch.delitem(registry, NAME, raising=False)
    first = TorchEngine(target_dir, None, pack_cpu_linears=False)
    second = TorchEngine(target_dir, None, pack_cpu_linears=False)
    first.close()
    assert first.model.config._attn_implementation == "sdpa"
    assert all(NAME in registry for registry in registries)  # the second model still runs it
    second.close()
    second.close()  # once only
    assert second.model.config._attn_implementation == "sdpa"
    assert not any(NAME in registry for registry in registries)
