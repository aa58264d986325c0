"""A load that cannot fit this machine is refused before any weight is allocated: the real
config.json of a 72B model (290 GB in float32) in the hub cache, loaded through /dflash/load,
gets a 400 that names what it needs and what is available, and the serving pair keeps serving.
Loading the target is a tripwire: reaching it would mean the fit was not asked first."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import httpx
import pytest
from service_support import assert_openai_error, make_pair, start_service

REPO = "owner/huge"
# Qwen2.5-72B-Instruct's config.json, as published
HUGE_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 8192,
    "intermediate_size": 29568, "num_hidden_layers": 80, "num_attention_heads": 64,
    "num_key_value_heads": 8, "vocab_size": 152064, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "hidden_act": "silu", "bos_token_id": 151643,
    "eos_token_id": 151645, "sliding_window": 131072, "use_sliding_window": False,
}
HI = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}


def cache_huge_repo(cache: Path) -> Path:
    """A finished download of REPO: its config and a small weights file (the fit reads the
    config's shapes; the files may hold less than the model allocates)."""
    commit = hashlib.sha1(REPO.encode()).hexdigest()
    root = cache / f"models--{REPO.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(HUGE_CONFIG))
    (snapshot / "model.safetensors").write_bytes(b"\0" * 4096)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    cache = tmp_path_factory.mktemp("hub")
    cache_huge_repo(cache)
    state, server = start_service(*make_pair(tmp_path_factory.mktemp("pair")), hub_cache_dir=cache)
    yield state, server
    server.stop()


def test_a_load_that_cannot_fit_is_refused_and_the_pair_keeps_serving(service, monkeypatch):
    from dflash_local.engines.torch_engine import TorchEngine

    _state, server = service
    before = httpx.post(server.url + "/v1/chat/completions", json=HI, timeout=60).json()
    reached = []

    def tripwire(*args):
        reached.append(args)
        raise MemoryError("the target was loaded: weights would have been allocated")

    monkeypatch.setattr(TorchEngine, "load_target", tripwire)
    refused = httpx.post(server.url + "/dflash/load", json={"target": REPO}, timeout=120)
    monkeypatch.undo()
    error = assert_openai_error(refused, 400, "model_too_large")
    assert not reached
    message = error["message"]
    assert REPO in message and "needs" in message and "available" in message, message
    assert "/" not in message.replace(REPO, ""), message  # no server path
    after = httpx.post(server.url + "/v1/chat/completions", json=HI, timeout=60).json()
    assert after["model"] == "tiny"
    assert after["choices"][0]["message"] == before["choices"][0]["message"]


@pytest.mark.parametrize("command", [["generate", "--no-speculative", "Hi"],
                                     ["bench", "--max-samples", "1", "--drafter", "SNAPSHOT"]])
def test_the_commands_refuse_it_at_start(tmp_path, monkeypatch, capsys, command):
    from dflash_local.cli.main import main
    from dflash_local.engines.torch_engine import TorchEngine

    def tripwire(*args):
        raise AssertionError("the target was loaded: weights would have been allocated")

    monkeypatch.setattr(TorchEngine, "load_target", tripwire)
    snapshot = cache_huge_repo(tmp_path)
    command = [str(snapshot) if word == "SNAPSHOT" else word for word in command]
    assert main([command[0], "--engine", "transformers", "--target", str(snapshot),
                 *command[1:]]) == 2
    assert re.search(r"error: .* needs [0-9.]+ GB .* has [0-9.]+ GB available", capsys.readouterr().err)
