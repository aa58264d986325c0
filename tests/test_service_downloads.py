"""Downloads through the real huggingface_hub code path, served by a local hub; offline behaviour."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
from service_support import LocalHub, make_pair, start_service, torch_loader, wait_until

from dflash_local.pairs.hub import resolve_model
from dflash_local.pairs.hub_download import Download, RepoRef
from dflash_local.pairs.memory_budget import engine_budgets
from dflash_local.pairs.memory_fit import estimate_fit, kv_cache_bytes

TARGET, DRAFTER = "test/tiny-target", "test/tiny-drafter"
HOLD_AFTER = 64 * 1024  # bytes of a big file the local hub sends before holding the rest


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("pair"))


def pair_refs() -> list[RepoRef]:
    return [RepoRef(TARGET), RepoRef(DRAFTER, role="drafter")]


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_download_fills_the_cache_with_progress(pair, tmp_path):
    events = []
    listed = []  # what the download hands its fit: the configs and weights' bytes by role
    with LocalHub({TARGET: pair[0], DRAFTER: pair[1]}) as hub:
        download = Download(pair_refs(), cache_dir=tmp_path, endpoint=hub.url,
                            fit_of=lambda configs, weights: listed.append((configs, weights)) or {})
        download.subscribe(events.append)
        assert download.start().wait(120)
    final = download.snapshot()
    assert final["status"] == "done", final
    assert final["bytes_done"] == final["bytes_total"] > 1_000_000
    assert [e["status"] for e in events][-1] == "done"
    done = [e["bytes_done"] for e in events]
    assert done == sorted(done)
    for role, source in (("target", pair[0]), ("drafter", pair[1])):
        snapshot = Path(final["paths"][role])
        for name in ("config.json", "model.safetensors"):
            assert (snapshot / name).read_bytes() == (source / name).read_bytes()
    # the cache now answers offline, and says the snapshot is complete
    assert resolve_model(TARGET, local_only=True, cache_dir=tmp_path) == Path(final["paths"]["target"])
    [(configs, weights)] = listed
    for role, source in (("target", pair[0]), ("drafter", pair[1])):
        assert configs[role] == json.loads((source / "config.json").read_text())
        assert weights[role] == (source / "model.safetensors").stat().st_size


def test_cancel_mid_file_leaves_no_partial_blob(pair, tmp_path):
    with LocalHub({TARGET: pair[0], DRAFTER: pair[1]}, hold_after=HOLD_AFTER) as hub:
        download = Download(pair_refs(), cache_dir=tmp_path, endpoint=hub.url).start()
        assert hub.holding.wait(60)
        # huggingface_hub writes the file being fetched as <etag>.<random>.incomplete
        wait_until(lambda: list(tmp_path.rglob("*.incomplete")))
        assert download.cancel()
        hub.release.set()
        assert download.wait(60)
        final = download.snapshot()
        assert final["status"] == "cancelled" and final["error_code"] == "cancelled"
        assert final["bytes_done"] < final["bytes_total"]
        assert list(tmp_path.rglob("*.incomplete")) == []  # nothing half-written stays
        weights_etag = hashlib_sha256(pair[0] / "model.safetensors")
        assert not list(tmp_path.rglob(weights_etag))  # no blob for the weights at all
        with pytest.raises(Exception, match="not in the local Hugging Face cache"):
            resolve_model(TARGET, local_only=True, cache_dir=tmp_path)
        assert not download.cancel()  # already finished
        # downloading again completes, byte for byte
        hub.hold_after = None
        again = Download(pair_refs(), cache_dir=tmp_path, endpoint=hub.url).start()
        assert again.wait(120) and again.snapshot()["status"] == "done"
    snapshot = Path(again.snapshot()["paths"]["target"])
    assert (snapshot / "model.safetensors").read_bytes() == (pair[0] / "model.safetensors").read_bytes()


def test_incompatible_pair_is_refused_before_any_weights(pair, tmp_path):
    wrong = tmp_path / "wrong-drafter"
    shutil.copytree(pair[1], wrong)
    config = json.loads((wrong / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [1, 40]
    (wrong / "config.json").write_text(json.dumps(config))
    with LocalHub({TARGET: pair[0], DRAFTER: wrong}) as hub:
        download = Download(pair_refs(), cache_dir=tmp_path / "cache", endpoint=hub.url).start()
        assert download.wait(60)
    final = download.snapshot()
    assert (final["status"], final["error_code"]) == ("failed", "incompatible_pair")
    assert "drafter tap 40 >= target layers 6" in final["error"]
    assert not [path for method, path in hub.requests
                if method == "GET" and path.endswith(".safetensors")]


def test_unknown_repo_fails_with_a_clear_message(tmp_path, pair):
    with LocalHub({TARGET: pair[0]}) as hub:
        download = Download([RepoRef("nobody/no-such-model")], cache_dir=tmp_path,
                            endpoint=hub.url).start()
        assert download.wait(60)
    final = download.snapshot()
    assert final["status"] == "failed" and final["error_code"] == "model_not_found"
    assert "has no repo 'nobody/no-such-model'" in final["error"]


def test_unreachable_hub_fails_with_a_clear_message(tmp_path):
    download = Download([RepoRef("nobody/no-such-model")], cache_dir=tmp_path,
                        endpoint=closed_port_url()).start()
    assert download.wait(60)
    final = download.snapshot()
    assert final["status"] == "failed"
    assert "unreachable" in final["error"] and "not in the local cache" in final["error"]


def test_offline_mode_fails_with_a_clear_message(tmp_path):
    """HF_HUB_OFFLINE is read when huggingface_hub is imported: a fresh process, for real."""
    code = textwrap.dedent(f"""
        import json
        from dflash_local.pairs.hub_download import Download, RepoRef
        d = Download([RepoRef("nobody/no-such-model")], cache_dir={str(tmp_path)!r}).start()
        d.wait(60)
        print(json.dumps(d.snapshot()))
    """)
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=120, check=True)
    final = json.loads(result.stdout.strip().splitlines()[-1])
    assert final["status"] == "failed"
    assert "offline mode is on (HF_HUB_OFFLINE=1)" in final["error"]


def test_fit_estimate():
    qwen3_8b = {"num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                "head_dim": 128, "hidden_size": 4096, "torch_dtype": "bfloat16"}
    assert kv_cache_bytes(qwen3_8b, 4096) == 2 * 36 * 8 * 128 * 4096 * 2
    hybrid = {"text_config": {**qwen3_8b, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                              "num_hidden_layers": 4}}
    assert kv_cache_bytes(hybrid, 1000) == 2 * 1 * 8 * 128 * 1000 * 2
    sliding = {**qwen3_8b, "num_hidden_layers": 2, "sliding_window": 100,
               "layer_types": ["sliding_attention", "full_attention"]}
    assert kv_cache_bytes(sliding, 1000) == 2 * 8 * 128 * (100 + 1000) * 2
    fit = estimate_fit(16 * 10**9, qwen3_8b, 4096, available_bytes=8 * 10**9)
    parts = fit.kv_bytes + fit.drafter_kv_bytes + fit.state_bytes + fit.working_bytes
    assert not fit.fits and fit.to_json()["total_bytes"] == 16 * 10**9 + parts


def hashlib_sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- through the service ---

CATALOG = """
[[pair]]
id = "embedded"
engines = ["transformers"]
thinking = "none"
model_type = "llama"
block_size = { transformers = 8 }
target = { repo = "SmolLM2-135M-Instruct", source = "embedded" }
drafter = { repo = "models/smollm2-135m-dflash", source = "shipped" }

[[pair]]
id = "tiny"
engines = ["transformers"]
thinking = "none"
model_type = "qwen3"
block_size = { transformers = 4 }
target = { repo = "test/tiny-target", source = "hub" }
drafter = { repo = "test/tiny-drafter", source = "hub" }
"""


def service_without_pair(tmp_path, endpoint: str):
    from dflash_local.pairs.catalog import load_catalog
    from dflash_local.service.app import create_app
    from dflash_local.service.server import BackgroundServer
    from dflash_local.service.state import ServiceState

    (tmp_path / "catalog.toml").write_text(CATALOG)
    state = ServiceState(catalog=load_catalog(tmp_path / "catalog.toml"), loader=torch_loader,
                         hub_endpoint=endpoint, hub_cache_dir=tmp_path / "cache")
    return BackgroundServer(create_app(state)).start()


def follow_events(url: str) -> list[dict]:
    events = []
    with httpx.stream("GET", url, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                if line == "data: [DONE]":
                    break
                events.append(json.loads(line[6:]))
    return events


def tiny_available(server) -> dict:
    pairs = httpx.get(server.url + "/dflash/catalog", timeout=60).json()["pairs"]
    return next(p for p in pairs if p["id"] == "tiny")["available"]


def test_service_downloads_then_loads_a_pair(pair, tmp_path):
    with LocalHub({TARGET: pair[0], DRAFTER: pair[1]}) as hub:
        server = service_without_pair(tmp_path, hub.url)
        try:
            chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}
            not_loaded = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60)
            assert (not_loaded.status_code, not_loaded.json()["error"]["code"]) == (503, "model_not_loaded")
            assert tiny_available(server) == {"target": False, "drafter": False}
            started = httpx.post(server.url + "/dflash/downloads", json={"pair": "tiny"}, timeout=60)
            assert started.status_code == 202
            events = follow_events(server.url + started.json()["events"])
            assert events[-1]["status"] == "done", events[-1]
            assert events[-1]["bytes_done"] == events[-1]["bytes_total"] > 0
            # the download's fit is the catalog's (pair_fit.py), worked from the hub's listing
            fit = events[-1]["fit"]["transformers"]
            assert fit["budget_bytes"] == engine_budgets()["transformers"].budget_bytes
            assert fit["fit"]["drafter_kv_bytes"] > 0 and fit["label"].startswith("fits")
            assert fit["fit"]["kv_bytes"] == kv_cache_bytes(json.loads((pair[0] / "config.json").read_text()), 4096)
            listed = httpx.get(server.url + "/dflash/catalog", params={"context_tokens": 4096},
                               timeout=60).json()["pairs"]
            catalog_fit = next(p for p in listed if p["id"] == "tiny")["fit"]["transformers"]["fit"]
            for part in ("weights_bytes", "kv_bytes", "drafter_kv_bytes", "state_bytes",
                         "working_bytes", "total_bytes", "basis"):
                assert fit["fit"][part] == catalog_fit[part], part
            assert tiny_available(server) == {"target": True, "drafter": True}
            loaded = httpx.post(server.url + "/dflash/load", json={"pair": "tiny"}, timeout=120)
            assert loaded.status_code == 200, loaded.text
            assert loaded.json()["loaded"]["default_block_size"] == 4
            for model in ("tiny", TARGET, None):
                reply = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                                   json={**chat, "model": model})
                assert reply.status_code == 200 and reply.json()["model"] == "tiny"
            loaded_by_repo = httpx.post(server.url + "/dflash/load", timeout=120,
                                        json={"target": TARGET, "drafter": DRAFTER})
            assert loaded_by_repo.json()["loaded"]["served_name"] == TARGET
        finally:
            server.stop()


def test_service_cancels_a_download(pair, tmp_path):
    with LocalHub({TARGET: pair[0], DRAFTER: pair[1]}, hold_after=HOLD_AFTER) as hub:
        server = service_without_pair(tmp_path, hub.url)
        try:
            started = httpx.post(server.url + "/dflash/downloads", json={"pair": "tiny"}, timeout=60)
            download_id = started.json()["id"]
            assert hub.holding.wait(60)
            cancelled = httpx.delete(f"{server.url}/dflash/downloads/{download_id}", timeout=60)
            assert cancelled.status_code == 200 and cancelled.json()["cancel_requested"] is True
            hub.release.set()
            events = follow_events(f"{server.url}/dflash/downloads/{download_id}/events")
            assert events[-1]["status"] == "cancelled"
            assert tiny_available(server)["target"] is False
        finally:
            server.stop()


def test_service_download_while_offline_reports_failure(pair, tmp_path):
    _state, server = start_service(*pair, hub_endpoint=closed_port_url(), hub_cache_dir=tmp_path)
    try:
        started = httpx.post(server.url + "/dflash/downloads", json={"pair": "qwen3-8b"}, timeout=60)
        assert started.status_code == 202
        events = follow_events(server.url + started.json()["events"])
        assert events[-1]["status"] == "failed" and "unreachable" in events[-1]["error"]
        listed = httpx.get(server.url + "/dflash/downloads", timeout=60).json()["downloads"]
        assert [d["status"] for d in listed] == ["failed"]
    finally:
        server.stop()


def test_a_download_is_finished_before_its_outcome_is_heard(tmp_path):
    """A client that starts the pair again on `failed` gets a new download, not this one."""
    heard = []
    download = Download([RepoRef(TARGET)], cache_dir=tmp_path, endpoint=closed_port_url())
    download.subscribe(lambda snapshot: heard.append((snapshot["status"], download.finished)))
    assert download.start().wait(60)
    assert heard[-1] == ("failed", True)
    assert all(finished for status, finished in heard if status in ("done", "failed"))


def test_a_finished_download_is_complete_until_a_file_is_cut_short(pair, tmp_path):
    from dflash_local.pairs.snapshot_manifest import MANIFEST, IncompleteSnapshotError

    with LocalHub({TARGET: pair[0], DRAFTER: pair[1]}) as hub:
        download = Download(pair_refs(), cache_dir=tmp_path, endpoint=hub.url).start()
        assert download.wait(120) and download.snapshot()["status"] == "done"
    snapshot = Path(download.snapshot()["paths"]["target"])
    assert "model.safetensors" in json.loads((snapshot / MANIFEST).read_text())["files"]
    assert resolve_model(TARGET, local_only=True, cache_dir=tmp_path) == snapshot
    weights = snapshot / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # cut short, as a crash mid-write would
    with pytest.raises(IncompleteSnapshotError, match="incomplete: resume or delete"):
        resolve_model(TARGET, local_only=True, cache_dir=tmp_path)


def test_a_partial_download_says_incomplete_everywhere(pair, tmp_path):
    wrong = tmp_path / "wrong-drafter"  # refused after the config files are in the cache
    shutil.copytree(pair[1], wrong)
    config = json.loads((wrong / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [1, 40]
    (wrong / "config.json").write_text(json.dumps(config))
    with LocalHub({TARGET: pair[0], DRAFTER: wrong}) as hub:
        server = service_without_pair(tmp_path, hub.url)
        try:
            started = httpx.post(server.url + "/dflash/downloads", json={"pair": "tiny"}, timeout=60)
            assert follow_events(server.url + started.json()["events"])[-1]["status"] == "failed"
            pairs = httpx.get(server.url + "/dflash/catalog", timeout=60).json()["pairs"]
            listed = next(p for p in pairs if p["id"] == "tiny")
            assert listed["available"] == {"target": False, "drafter": False}
            assert listed["incomplete"] == {"target": "incomplete: resume or delete",
                                            "drafter": "incomplete: resume or delete"}
            refused = httpx.post(server.url + "/dflash/load", json={"pair": "tiny"}, timeout=60)
            assert refused.status_code == 404
            assert "test/tiny-target is incomplete: resume or delete" in refused.json()["error"]["message"]
        finally:
            server.stop()
