"""dtype "auto": float32 on a CPU (the only exactly lossless choice measured here), the
checkpoint's own float type on a GPU."""

from __future__ import annotations

import pytest

from dflash_local.pairs.precision import checkpoint_dtype, resolve_dtype


@pytest.mark.parametrize(("config", "accelerator", "expected"), [
    ({"dtype": "bfloat16"}, False, "float32"),
    ({"dtype": "bfloat16"}, True, "bfloat16"),
    ({"torch_dtype": "float16"}, True, "float16"),  # transformers 4's key
    ({"text_config": {"dtype": "bfloat16"}}, True, "bfloat16"),  # multimodal wrappers
    ({"dtype": "float32"}, True, "float32"),
    ({"quantization": {"bits": 4}}, True, "bfloat16"),  # says nothing: a half type on a GPU
])
def test_auto_resolves_by_device_and_checkpoint(config, accelerator, expected):
    assert resolve_dtype("auto", accelerator=accelerator, target_config=config) == expected
    assert resolve_dtype("float16", accelerator=accelerator, target_config=config) == "float16"


@pytest.mark.parametrize("config", [{"dtype": "int8"}, {"text_config": "not a table"}, {}])
def test_a_config_without_a_float_type_declares_nothing(config):
    assert checkpoint_dtype(config) is None


def test_engines_take_auto_and_report_what_they_resolved(tmp_path_factory):
    from fixtures_tiny import tiny_engine, tiny_pair

    from dflash_local.engines.torch_engine import TorchEngine
    from dflash_local.errors import CheckpointError

    pair = tiny_pair(tmp_path_factory)
    assert TorchEngine(pair.target, pair.drafter, dtype="auto").pair.dtype == "float32"
    assert tiny_engine(pair).pair.dtype == "float32"
    with pytest.raises(CheckpointError, match="dtype 'float8'"):
        TorchEngine(pair.target, pair.drafter, dtype="float8")
