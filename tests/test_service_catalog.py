"""The catalog of pairs, the management endpoints with no pair loaded, and `dflash-local serve`."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import httpx
import pytest
from service_support import make_pair

from dflash_local.errors import CheckpointError, ModelNotFoundError
from dflash_local.pairs.catalog import THINKING_MODES, load_catalog, locate, pair_engines
from dflash_local.pairs.hub import is_repo_id


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


def test_embedded_pair_comes_first(catalog):
    embedded = catalog.pairs[0]
    assert embedded.id == "embedded"
    assert (embedded.target.source, embedded.target.repo) == ("embedded", "SmolLM2-135M-Instruct")
    assert (embedded.drafter.source, embedded.drafter.repo) == ("shipped", "models/smollm2-135m-dflash")


def test_every_pair_is_complete(catalog):
    assert len({pair.id for pair in catalog.pairs}) == len(catalog.pairs)
    for pair in catalog.pairs:
        assert set(pair.engines) <= set(pair_engines()) and pair.thinking in THINKING_MODES
        assert {engine for engine, _ in pair.block_sizes} == set(pair.engines), pair.id
        for model in (pair.target, pair.drafter):
            assert model.source != "hub" or is_repo_id(model.repo), model
            assert model.revision is None  # none pinned yet: written without hub access


def test_known_pairs(catalog):
    by_id = {pair.id: pair for pair in catalog.pairs}
    expected = {
        "qwen3.6-35b-a3b-mlx-4bit": ("mlx-community/Qwen3.6-35B-A3B-4bit", "z-lab/Qwen3.6-35B-A3B-DFlash"),
        "gemma-4-31b-it-mlx-4bit": ("mlx-community/gemma-4-31b-it-4bit", "z-lab/gemma-4-31B-it-DFlash"),
        "qwen3-8b-mlx-4bit": ("mlx-community/Qwen3-8B-4bit", "z-lab/Qwen3-8B-DFlash-b16"),
        "qwen3.5-4b-mlx": ("Qwen/Qwen3.5-4B", "z-lab/Qwen3.5-4B-DFlash"),
        "qwen3-8b": ("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16"),
        "llama3.1-8b-instruct": ("meta-llama/Llama-3.1-8B-Instruct",
                                 "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"),
    }
    for pair_id, (target, drafter) in expected.items():
        assert (by_id[pair_id].target.repo, by_id[pair_id].drafter.repo) == (target, drafter)
    assert by_id["qwen3-8b-mlx-4bit"].block_size_for("mlx") <= 8  # quantized verify is costly
    assert by_id["qwen3-8b"].thinking == "off" and by_id["qwen3.5-9b"].thinking == "on"
    assert "qwen3-8b" in {pair.id for pair in catalog.for_engine("transformers")}
    assert all("mlx" in pair.engines for pair in catalog.for_engine("mlx"))
    with pytest.raises(ModelNotFoundError, match="no pair 'nope'"):
        catalog.get("nope")


@pytest.mark.parametrize("broken,message", [
    ('[[pair]]\nid = "x"\n', "first pair must be 'embedded'|'engines' must be a list"),
    ("[[pair]\n", "cannot read the catalog"),
    ('[[pair]]\nid = "embedded"\nengines = ["tpu"]\n', "must be a non-empty subset"),
    ('[[pair]]\nid = "embedded"\nengines = ["mlx"]\nthinking = "maybe"\n', "thinking 'maybe'"),
    ('[[pair]]\nid = "embedded"\nengines = ["mlx"]\nthinking = "on"\nblock_size = { vllm = 4 }\n',
     "name an engine the pair lacks"),
])
def test_broken_catalogs_say_what_is_wrong(tmp_path, broken, message):
    path = tmp_path / "catalog.toml"
    path.write_text(broken)
    with pytest.raises(CheckpointError, match=message):
        load_catalog(path)


def test_each_drafter_says_its_dflash_version(catalog):
    by_id = {pair.id: pair for pair in catalog.pairs}
    assert by_id["qwen3-8b"].drafter_version == 1  # absent from the table: DFlash 1
    assert by_id["qwen3.8-27b-dflash2"].drafter_version == 2
    assert by_id["qwen3.8-27b-dflash2"].drafter.repo == "z-lab/Qwen3.8-27B-DFlash2"
    assert {pair.drafter_version for pair in catalog.pairs} <= {1, 2}
    as_json = by_id["qwen3.8-27b-dflash2"].to_json()
    assert as_json["drafter"]["version"] == 2 and as_json["drafter"]["repo"].endswith("DFlash2")
    # the shipped drafter's own checkpoint says the same as its catalog entry
    from dflash_local import paths
    from dflash_local.drafter.config import load_drafter_config

    shipped = load_drafter_config(paths.shipped_models_dir() / "smollm2-135m-dflash")
    assert by_id["embedded"].to_json()["drafter"]["version"] == (2 if shipped.dflash2 else 1) == 2


@pytest.mark.parametrize(("written", "value"), [("3", 3), ('"2"', "2"), ("true", True), ("0", 0)])
def test_a_bad_drafter_version_names_the_pair_and_the_value(tmp_path, written, value):
    path = tmp_path / "catalog.toml"
    path.write_text('[[pair]]\nid = "embedded"\nengines = ["mlx"]\nthinking = "on"\n'
                    'block_size = { mlx = 4 }\ntarget = { repo = "t", source = "embedded" }\n'
                    f'drafter = {{ repo = "d", source = "shipped", version = {written} }}\n')
    message = rf"'embedded'.* drafter: version {re.escape(repr(value))} is not one of \(1, 2\)"
    with pytest.raises(CheckpointError, match=message):
        load_catalog(path)


def test_a_missing_shipped_drafter_is_reported(catalog, monkeypatch, tmp_path):
    monkeypatch.setattr("dflash_local.paths.shipped_models_dir", lambda: tmp_path)
    with pytest.raises(ModelNotFoundError, match="shipped drafter"):
        locate(catalog.pairs[0].drafter)


def test_management_endpoints_with_no_pair_loaded(tmp_path):
    from dflash_local.service.app import create_app
    from dflash_local.service.server import BackgroundServer
    from dflash_local.service.state import ServiceState

    with BackgroundServer(create_app(ServiceState(hub_cache_dir=tmp_path))) as server:
        pairs = httpx.get(server.url + "/dflash/catalog", timeout=60).json()["pairs"]
        assert pairs[0]["id"] == "embedded" and len(pairs) == len(load_catalog().pairs)
        assert pairs[1]["available"] == {"target": False, "drafter": False}
        assert pairs[1]["target"]["revision_pinned"] is False
        for pair in pairs:  # every engine a pair names: runs here with an estimate, or says why not
            assert set(pair["fit"]) == set(pair["engines"]), pair["id"]
            for entry in pair["fit"].values():
                assert entry["label"] and (entry["runs_here"] or "cannot run here" in entry["label"])
        bad = httpx.get(server.url + "/dflash/catalog", params={"context_tokens": 0}, timeout=60)
        assert bad.status_code == 400 and "context_tokens 0" in bad.text
        status = httpx.get(server.url + "/dflash/status", timeout=60).json()
        assert status["loaded"] is None and status["memory"]["rss_bytes"] > 0
        assert httpx.get(server.url + "/v1/models").json()["data"] == []
        assert httpx.get(server.url + "/health").json() == {"status": "ok", "model": None,
                                                            "loading": None}


def test_a_listing_locates_and_sizes_each_model_once(tmp_path, monkeypatch):
    from collections import Counter

    from dflash_local.pairs import catalog as catalog_module
    from dflash_local.pairs import pair_fit
    from dflash_local.service.app import create_app
    from dflash_local.service.server import BackgroundServer
    from dflash_local.service.state import ServiceState

    located, sized = Counter(), Counter()
    real_locate, real_disk_bytes = catalog_module.locate, pair_fit.disk_bytes

    def counted_locate(model, *args, **kwargs):
        located[model] += 1
        return real_locate(model, *args, **kwargs)

    def counted_disk_bytes(local_dir):
        sized[local_dir] += 1
        return real_disk_bytes(local_dir)

    monkeypatch.setattr(catalog_module, "locate", counted_locate)
    monkeypatch.setattr(pair_fit, "disk_bytes", counted_disk_bytes)
    with BackgroundServer(create_app(ServiceState(hub_cache_dir=tmp_path))) as server:
        pairs = httpx.get(server.url + "/dflash/catalog", timeout=60).json()["pairs"]
    models = {model for pair in load_catalog().pairs for model in (pair.target, pair.drafter)}
    assert set(located) == models and set(located.values()) == {1}
    assert sized and set(sized.values()) == {1}  # the embedded pair's files, here
    assert pairs[0]["available"]["drafter"] is True


def test_the_loaded_pair_shows_its_own_fit(tmp_path):
    """Its files, in the dtype it runs in (float32 on a CPU), at the catalog's context."""
    import json

    from service_support import start_service

    from dflash_local.pairs.memory_fit import config_dtype_bytes, kv_cache_bytes

    target, drafter = make_pair(tmp_path)
    state, server = start_service(target, drafter)
    try:
        state.loaded.pair_id = "embedded"  # as if the catalog's own pair were loaded
        status = httpx.get(server.url + "/dflash/status", timeout=60).json()
        listing = httpx.get(server.url + "/dflash/catalog", params={"context_tokens": 64},
                            timeout=60).json()
    finally:
        server.stop()
        state.shutdown()
    row = next(pair for pair in listing["pairs"] if pair["id"] == "embedded")
    fit = row["fit"]["transformers"]["fit"]
    configs = {folder: json.loads((folder / "config.json").read_text()) for folder in (target, drafter)}
    # held in float32: a bfloat16 checkpoint (the drafter's) doubles, a float32 one stays
    in_memory = sum(path.stat().st_size * 4 // config_dtype_bytes(configs[folder])
                    for folder in (target, drafter) for path in folder.glob("*.safetensors"))
    assert {config_dtype_bytes(config) for config in configs.values()} == {2, 4}
    assert row["loaded"] and fit["weights_bytes"] == in_memory
    assert fit["kv_bytes"] == kv_cache_bytes(configs[target], 64, 4) and fit["context_tokens"] == 64
    assert status["loaded_fit"]["fit"]["weights_bytes"] == in_memory
    assert status["loaded_fit"]["label"] == status["loaded_fit"]["fit"]["label"]


def test_serve_command_end_to_end(tmp_path):
    target, drafter = make_pair(tmp_path)
    env = {**os.environ, "DFLASH_LOCAL_HOME": str(tmp_path / "home")}
    command = [sys.executable, "-m", "dflash_local.cli.main", "serve", "--port", "0", "--target",
               str(target), "--drafter", str(drafter), "--api-key", "k3y"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=env)
    try:
        # block size auto by default: the pair is calibrated before it serves, and it says so
        before = process.stdout.readline()
        assert before.startswith("dflash-local calibrating target "), before
        line = process.stdout.readline()
        url = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
        assert url, (line, process.stderr.read() if process.poll() is not None else "")
        url = url[1]
        assert httpx.get(url + "/health", timeout=60).json()["model"] == "target"
        reply = httpx.post(url + "/v1/chat/completions", timeout=60,
                           headers={"Authorization": "Bearer k3y"},
                           json={"model": "target", "max_tokens": 3,
                                 "messages": [{"role": "user", "content": "Hi"}]})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
        assert httpx.get(url + "/v1/models", timeout=60).status_code == 401
    finally:
        process.terminate()
        # uvicorn shuts down gracefully, then re-raises the signal it caught
        assert process.wait(60) in (0, -signal.SIGTERM)


def test_the_embedded_pair_serves_plainly_until_its_drafter_ships(catalog, monkeypatch, tmp_path):
    from dflash_local.service.state import ServiceState

    monkeypatch.setattr("dflash_local.paths.shipped_models_dir", lambda: tmp_path)
    state = ServiceState(catalog=catalog, hub_cache_dir=tmp_path)
    drafter, warning = state._locate_drafter(catalog.get("embedded"))
    assert drafter is None and "decoding without speculation" in warning
    with pytest.raises(ModelNotFoundError, match="not in the local Hugging Face cache"):
        state._locate_drafter(catalog.get("qwen3-8b"))  # a hub drafter must be downloaded
