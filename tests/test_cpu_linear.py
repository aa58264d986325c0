"""oneDNN-packed linears: the same function as nn.Linear, row results independent of the row
count (what keeps verify rows equal to plain decoding's), and no second copy of a weight."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from dflash_local.accel import torch_linear
from dflash_local.accel.torch_linear import PackedLinear, pack_linears, packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_computes_what_nn_linear_computes(bias):
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=bias)
    packed = PackedLinear(linear, rows_hint=16)
    for shape in [(1, 64), (1, 7, 64), (2, 3, 64), (40, 64)]:  # 40 rows: above the hint
        x = torch.randn(*shape)
        out = packed(x)
        assert out.shape == (*shape[:-1], 96)
        torch.testing.assert_close(out, linear(x), rtol=1e-5, atol=1e-5)


def test_a_rows_result_does_not_depend_on_how_many_rows_came_with_it():
    torch.manual_seed(1)
    packed = PackedLinear(nn.Linear(576, 1536, bias=False), rows_hint=16)
    block = torch.randn(16, 576)
    together = packed(block)
    for width in (1, 2, 5, 16):
        assert torch.equal(packed(block[:width]), together[:width]), width  # bit for bit


def test_pack_linears_replaces_every_float32_linear_and_keeps_only_shared_weights():
    torch.manual_seed(2)
    embed = nn.Embedding(50, 32)
    model = nn.Sequential(nn.Linear(32, 32), nn.Sequential(nn.Linear(32, 64), nn.ReLU()),
                          nn.Linear(64, 50, bias=False), nn.Linear(32, 8).to(torch.bfloat16))
    model[2].weight = nn.Parameter(torch.randn(50, 64))  # larger than the default init: a real test
    tied = nn.Linear(32, 50, bias=False)
    tied.weight = embed.weight
    model.append(tied)
    x = torch.randn(3, 32)
    expected = model[2](model[1](model[0](x)))
    assert pack_linears(model, rows_hint=8, shared=(embed.weight,)) == 4  # not the bfloat16 one
    assert type(model[3]) is nn.Linear
    torch.testing.assert_close(model[2](model[1](model[0](x))), expected, rtol=1e-5, atol=1e-5)
    assert model[4].weight is embed.weight  # tied: still reachable, nothing copied
    assert not hasattr(model[0], "weight")  # released: only the reordered copy remains
    assert not any(p.requires_grad for p in model[1][0].parameters())


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_the_engine_lets_go_of_the_checkpoint_file_once_its_linears_are_packed(tmp_path):
    import tiny_models

    from dflash_local.engines.torch_engine import TorchEngine

    target = tiny_models.make_target(tmp_path / "target")
    weights = str((target / "model.safetensors").resolve())
    stock = TorchEngine(target, None, pack_cpu_linears=False)
    assert weights in Path("/proc/self/maps").read_text()  # the control: Transformers maps the file
    del stock
    engine = TorchEngine(target, None)
    assert weights not in Path("/proc/self/maps").read_text()  # no mapped view keeps it resident
    assert not any(type(m) is nn.Linear for m in engine.model.modules())


def test_an_untied_head_is_packed_and_released_and_speculative_still_equals_plain(tmp_path):
    import tiny_models
    from fixtures_tiny import params_of

    from dflash_local.engines.torch_engine import TorchEngine

    target = tiny_models.make_target(tmp_path / "target", tie=False)
    drafter = tiny_models.make_drafter(tmp_path / "drafter", target, block_size=8)
    engine = TorchEngine(target, drafter)
    head = engine.model.get_output_embeddings()
    assert isinstance(head, PackedLinear) and not hasattr(head, "weight")  # nothing kept alive
    assert engine.drafter._borrowed[1] is head
    prompt_ids = engine.encode_chat([{"role": "user", "content": "def add(a, b):"}])

    def tokens(**params):
        events = engine.stream(prompt_ids, params_of(max_tokens=24, stop_token_ids=(10_000,), **params))
        return [t for event in events for t in event.token_ids]

    plain = tokens(speculative=False)
    assert len(plain) == 24
    for block_size in (2, 8):
        assert tokens(block_size=block_size) == plain


def test_uninstall_puts_back_linears_with_the_same_weights_bit_for_bit():
    torch.manual_seed(3)
    embed = nn.Embedding(50, 32)
    model = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 50, bias=False), nn.Linear(32, 50, bias=False))
    model[2].weight = embed.weight  # tied
    before = {name: value.clone() for name, value in model.state_dict().items()}
    installed = torch_linear.install(model, rows_hint=8, shared=(embed.weight,))
    assert installed and all(type(layer) is PackedLinear for layer in model)
    installed.uninstall()
    assert all(type(layer) is nn.Linear for layer in model)
    assert model[2].weight is embed.weight
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[name], value) for name, value in before.items())
    assert not torch_linear.install(nn.Sequential(nn.Linear(4, 4).to(torch.bfloat16)), rows_hint=8)
