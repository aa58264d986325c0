"""Training DFlash 2 drafters: packed blocks convolved apart, a v1 drafter made DFlash 2 drafts as
it did, and `dflash-local train --version 2` writes a checkpoint z-lab's model loads and our
engine decodes losslessly."""

from __future__ import annotations

import json
import random

import pytest
import torch
from fixtures_tiny import collect, params_of
from test_train import synthetic_sequences
from tiny_models import make_target

from dflash_local.cli.main import main
from dflash_local.drafter.dflash2_torch import grouped_causal_conv


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("train-dflash2") / "target", layers=4, hidden=64)


def test_packed_blocks_are_convolved_each_on_its_own():
    torch.manual_seed(0)
    hidden, dynamic, base = torch.randn(2, 12, 32), torch.randn(2, 12, 4, 2), torch.randn(4, 32)
    packed = grouped_causal_conv(hidden, dynamic, base, 16, block=4)
    apart = [grouped_causal_conv(hidden[:, i : i + 4], dynamic[:, i : i + 4], base, 16) for i in (0, 4, 8)]
    torch.testing.assert_close(packed, torch.cat(apart, dim=1))
    assert not torch.allclose(packed, grouped_causal_conv(hidden, dynamic, base, 16))  # one sequence


def test_a_v1_drafter_made_dflash2_drafts_as_it_did(target):
    from transformers import AutoModelForCausalLM

    from dflash_local.drafter.model_torch import DFlashDrafter, DraftSession
    from dflash_local.train.batches import make_batch
    from dflash_local.train.trainer import (
        batch_loss,
        dflash2_sizes,
        drafter_config_for,
        start_dflash2_parts,
    )

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    v1_config = drafter_config_for(model.config, 2, 8, (0, 2), 3)
    torch.manual_seed(1)
    v1 = DFlashDrafter(v1_config).bind(model.get_input_embeddings(), model.get_output_embeddings())
    v2 = DFlashDrafter(drafter_config_for(model.config, 2, 8, (0, 2), 3, dflash2_sizes(64)))
    v2.bind(model.get_input_embeddings(), model.get_output_embeddings())
    loaded = v2.load_state_dict(v1.state_dict(), strict=False)
    assert not loaded.unexpected_keys and all("conv" in k or "selector" in k for k in loaded.missing_keys)
    start_dflash2_parts(v2)
    taps = torch.randn(1, 12, 128)
    with torch.inference_mode():
        hidden_v1 = v1.draft(torch.tensor([[40] + [3] * 7]), taps, v1.new_cache())
        hidden_v2 = v2.draft(torch.tensor([[40] + [3] * 7]), taps, v2.new_cache())
    torch.testing.assert_close(hidden_v2, hidden_v1)  # the convolutions pass rows through
    assert DraftSession(v2).propose(40, taps, 8) == DraftSession(v1).propose(40, taps, 8)
    # teacher-forced: the near-neutral selector picks what the logits pick; its loss adds on
    batch = make_batch(synthetic_sequences(4, 128), 3, 8, 3, 4.0, random.Random(0))
    with torch.no_grad():
        (loss_v1, metrics_v1), (loss_v2, metrics_v2) = batch_loss(v1, batch), batch_loss(v2, batch)
    assert metrics_v2 == metrics_v1 and loss_v2 > loss_v1


def test_train_version_2_from_a_v1_drafter(target, tmp_path, capsys):
    from dflash_local.drafter.config import load_drafter_config
    from dflash_local.drafter.model_torch import load_drafter
    from dflash_local.engines.torch_engine import TorchEngine

    zlab = pytest.importorskip("dflash.model")
    data = tmp_path / "data"
    data.mkdir()
    torch.save(synthetic_sequences(24, 128), data / "regen-00000.pt")  # 2 taps x hidden 64
    common = ["--target", str(target), "--data", str(data), "--regen-minutes", "0", "--steps", "3",
              "--draft-vocab", "0", "--lr", "3e-3"]
    v1 = tmp_path / "v1"
    assert main(["train", "--out", str(v1), "--layers", "1", "--block-size", "4", "--taps", "0,2",
                 *common]) == 0
    v2 = tmp_path / "v2"
    assert main(["train", "--out", str(v2), "--init-from", str(v1), "--version", "2", *common]) == 0
    config = load_drafter_config(v2)
    assert config.version == "dflash2" and config.dflash2.conv_group_size == 64
    assert json.loads((v2 / "training_report.json").read_text())["version"] == "dflash2"
    trained = load_drafter(v2)
    conv = trained.layers[0].attention_conv
    assert conv.kernel_projection.weight.abs().sum() > 0  # trained away from the identity
    assert not torch.equal(conv.base_kernel[:, 1:], torch.zeros_like(conv.base_kernel[:, 1:]))
    assert zlab.DFlash2DraftModel.from_pretrained(v2, dtype=torch.float32) is not None

    engine = TorchEngine(target, v2)
    prompt = engine.encode_chat([{"role": "user", "content": "Hello there"}])
    plain, _ = collect(engine.stream(prompt, params_of(max_tokens=20, speculative=False)))
    assert collect(engine.stream(prompt, params_of(max_tokens=20, block_size=4)))[0] == plain

    capsys.readouterr()
    again = tmp_path / "again"  # continuing a DFlash 2 drafter stays DFlash 2 ...
    assert main(["train", "--out", str(again), "--init-from", str(v2), *common]) == 0
    assert load_drafter_config(again).dflash2 == config.dflash2
    assert main(["train", "--out", str(tmp_path / "back"), "--init-from", str(v2), "--version", "1",
                 *common]) == 2  # ... and going back to v1 would drop its parts
    assert "--version 1 would drop its convolutions and selector" in capsys.readouterr().err
