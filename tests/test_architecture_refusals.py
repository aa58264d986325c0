"""What an engine cannot run is refused from config.json before any weight loads (each target
here has its weights deleted: a load would fail otherwise), with a message naming the check, the
values and the engine that can run it: an architecture an engine has no rollback or class for,
an engine version without the support a hybrid target needs, a drafter whose taps the target's
layers do not reach, a drafter for another vocabulary."""

from __future__ import annotations

import json
import re
import sys

import pytest
import transformers
from arch_tiny import hf_target
from tiny_models import VOCAB, drafter_config_json
from transformers.cache_utils import DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

mlx_lm = pytest.importorskip("mlx_lm")

from dflash_local.engines.mlx_engine import MLXEngine
from dflash_local.engines.torch_engine import TorchEngine
from dflash_local.errors import CheckpointError, IncompatiblePairError

ENGINES = {"mlx": MLXEngine, "transformers": TorchEngine}


def weightless(target):
    """The target directory with its weights gone: only its config can be read."""
    for weights in target.glob("*.safetensors"):
        weights.unlink()
    return target


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A Qwen3.5 (GatedDeltaNet) target's config and tokenizer, no weights."""
    return weightless(hf_target(tmp_path_factory.mktemp("qwen3_5") / "target", "qwen3_5"))


def test_transformers_without_recurrent_past_recording_refuses_a_hybrid(hybrid, monkeypatch):
    monkeypatch.delattr(LinearAttentionCacheLayerMixin, "activate_past_recording")
    expected = (f"target model_type 'qwen3_5' is not supported by the Transformers engine (its "
                f"'linear_attention' layers cannot be rolled back: transformers "
                f"{transformers.__version__} keeps no per-row recurrent states")
    with pytest.raises(CheckpointError, match=re.escape(expected) + r".*MLX engine runs it \(--engine mlx\)"):
        TorchEngine(hybrid, None)


def test_transformers_without_sliding_past_recording_refuses_gpt_oss(tmp_path, monkeypatch):
    target = weightless(hf_target(tmp_path / "target", "gpt_oss"))
    monkeypatch.delattr(DynamicSlidingWindowLayer, "activate_past_recording")
    with pytest.raises(CheckpointError, match=r"'gpt_oss' .*'sliding_attention' layers cannot be "
                                              r"rolled back: transformers [\d.]+ has no past recording"):
        TorchEngine(target, None)


def test_transformers_refuses_recurrent_layers_it_has_not_verified(tmp_path):
    """OLMo-Hybrid's linear-attention layers exist in Transformers, but nothing here shows that
    they hand the cache a state per row: refused, not run on trust."""
    config = transformers.AutoConfig.for_model("olmo_hybrid")
    config.save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=r"'olmo_hybrid' is not supported by the Transformers "
                                              r"engine \(its 'linear_attention' layers are not known "
                                              r"to hand their cache per-row states \(known: qwen3_5, "
                                              r"qwen3_5_moe, qwen3_next\)\); vLLM or SGLang"):
        TorchEngine(tmp_path, None)


def test_an_mlx_lm_without_the_model_class_refuses_it(tmp_path, monkeypatch):
    from mlx_tiny import write_target

    target = weightless(write_target(tmp_path / "target", "qwen3_next"))
    monkeypatch.setitem(sys.modules, "mlx_lm.models.qwen3_next", None)  # as an older mlx-lm
    with pytest.raises(CheckpointError, match=(
            rf"'qwen3_next' is not supported by the MLX engine \(mlx-lm "
            rf"{re.escape(mlx_lm.__version__)} has no mlx_lm.models.qwen3_next: a newer mlx-lm has "
            rf"it\); the Transformers engine runs it \(--engine transformers\)")):
        MLXEngine(target, None)


def test_mlx_refuses_an_architecture_without_an_adapter(tmp_path):
    transformers.AutoConfig.for_model("olmo_hybrid").save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=r"'olmo_hybrid' is not supported by the MLX engine "
                                              r"\(supported: .*qwen3_next.*\); vLLM or SGLang"):
        MLXEngine(tmp_path, None)


def write_drafter_config(out, target, **fields):
    """A drafter directory with only its config.json (the check reads nothing else)."""
    raw = json.loads((target / "config.json").read_text())
    flat = out / "target-config"
    flat.mkdir(parents=True)
    (flat / "config.json").write_text(json.dumps(raw.get("text_config") or raw))
    drafter = out / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps(drafter_config_json(flat, **fields)))
    return drafter


@pytest.mark.parametrize("engine", ENGINES)
def test_taps_beyond_the_targets_layers_are_refused(hybrid, tmp_path, engine):
    drafter = write_drafter_config(tmp_path, hybrid, taps=[1, 9])
    with pytest.raises(IncompatiblePairError, match="drafter tap 9 >= target layers 4"):
        ENGINES[engine](hybrid, drafter)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_drafter_for_another_vocabulary_is_refused(hybrid, tmp_path, engine):
    drafter = write_drafter_config(tmp_path, hybrid, vocab_size=VOCAB + 40)
    with pytest.raises(IncompatiblePairError,
                       match=f"drafter vocab_size {VOCAB + 40} != target vocab_size {VOCAB}"):
        ENGINES[engine](hybrid, drafter)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_fitting_drafter_gets_past_every_check_to_the_weights(hybrid, tmp_path, engine):
    """The control: the same weightless target with a drafter that fits fails only where the
    weights load, so the refusals above come from the checks."""
    drafter = write_drafter_config(tmp_path, hybrid, taps=[0, 1, 2])
    with pytest.raises(Exception) as failure:
        ENGINES[engine](hybrid, drafter)
    assert not isinstance(failure.value, IncompatiblePairError)
    assert "not supported" not in str(failure.value)
    assert "safetensors" in str(failure.value) or "weight" in str(failure.value).lower()
