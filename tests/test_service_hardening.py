"""The service under faults: a load is transactional (a real failing load leaves the old pair
serving; the old pair serves while the new one loads), bodies are bounded even when chunked,
callers never see a server path, and the Host allow-list takes --allow-host."""

from __future__ import annotations

import argparse
import hashlib
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from service_support import assert_openai_error, make_pair, start_service, torch_loader

CHAT = "/v1/chat/completions"
HI = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}
SERVER_PATHS = ("/tmp/", "/root/", "/home/", "/work/", "/Users/")


def cache_repo(cache: Path, repo: str, source: Path, corrupt: bool = False) -> Path:
    """Put `source` into a Hugging Face cache as `repo`'s snapshot (as a finished download
    would; with `corrupt`, its weights are garbage of the right name)."""
    commit = hashlib.sha1(repo.encode()).hexdigest()
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    shutil.copytree(source, snapshot)
    if corrupt:
        (snapshot / "model.safetensors").write_bytes(b"\x00not a safetensors file" * 64)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def hub_cache(pair, tmp_path_factory):
    cache = tmp_path_factory.mktemp("hub")
    target, drafter = pair
    cache_repo(cache, "owner/good", target)
    cache_repo(cache, "owner/good-drafter", drafter)
    cache_repo(cache, "owner/broken", target, corrupt=True)
    return cache


@pytest.fixture
def service(pair, hub_cache):
    state, server = start_service(*pair, hub_cache_dir=hub_cache)
    yield state, server
    server.stop()


def served_models(url: str) -> list[str]:
    return [model["id"] for model in httpx.get(url + "/v1/models").json()["data"]]


def test_a_failed_load_leaves_the_old_pair_serving(service):
    _state, server = service
    before = httpx.post(server.url + CHAT, json=HI, timeout=60).json()
    failed = httpx.post(server.url + "/dflash/load", json={"target": "owner/broken"}, timeout=120)
    error = assert_openai_error(failed, 503, "load_failed")
    assert "tiny still serves" in error["message"]
    assert served_models(server.url) == ["tiny"]
    after = httpx.post(server.url + CHAT, json=HI, timeout=60).json()
    assert after["choices"][0]["message"] == before["choices"][0]["message"]
    status = httpx.get(server.url + "/dflash/status").text
    assert '"load_error":"' in status and not any(path in status for path in SERVER_PATHS)


def test_an_unknown_engine_is_refused_and_the_pair_kept(service):
    _state, server = service
    refused = httpx.post(server.url + "/dflash/load", json={"target": "owner/good", "engine": "foo"})
    assert "'foo'" in assert_openai_error(refused, 400, "invalid_request")["message"]
    assert served_models(server.url) == ["tiny"]


def test_the_old_pair_serves_while_the_new_one_loads(pair, hub_cache):
    release, entered = threading.Event(), threading.Event()

    def slow_loader(*args, **kwargs):  # the real loader, once the test lets it go on
        entered.set()
        release.wait(60)
        return torch_loader(*args, **kwargs)

    state, server = start_service(*pair, hub_cache_dir=hub_cache)
    try:
        state.loader = slow_loader
        with ThreadPoolExecutor(1) as pool:
            loading = pool.submit(httpx.post, server.url + "/dflash/load", timeout=120,
                                  json={"target": "owner/good", "drafter": "owner/good-drafter"})
            assert entered.wait(60)
            meanwhile = httpx.post(server.url + CHAT, json=HI, timeout=60)
            assert meanwhile.status_code == 200 and meanwhile.json()["model"] == "tiny"
            assert httpx.get(server.url + "/health").json()["loading"] == "owner/good"
            release.set()
            assert loading.result().status_code == 200
        assert served_models(server.url) == ["owner/good"]
        described = httpx.get(server.url + "/v1/models").json()["data"][0]["dflash"]
        assert (described["target"], described["drafter"]) == ("owner/good", "owner/good-drafter")
        assert httpx.post(server.url + CHAT, json=HI, timeout=60).json()["model"] == "owner/good"
    finally:
        release.set()
        server.stop()


def test_callers_see_no_server_paths(service):
    _state, server = service  # the tiny pair was loaded from absolute temporary directories
    for path in ("/v1/models", "/dflash/status", "/dflash/catalog", "/health"):
        text = httpx.get(server.url + path, timeout=60).text
        assert not any(root in text for root in SERVER_PATHS), (path, text[:300])
    described = httpx.get(server.url + "/v1/models").json()["data"][0]["dflash"]
    assert (described["target"], described["drafter"]) == ("target", "drafter")


def test_a_chunked_body_over_the_limit_is_refused(pair):
    _state, server = start_service(*pair, app_options={"max_body_bytes": 1000})
    try:
        def chunks():  # no Content-Length: httpx sends it chunked
            for _ in range(20):
                yield b" " * 100

        refused = httpx.post(server.url + CHAT, content=chunks(),
                             headers={"content-type": "application/json"}, timeout=60)
        assert "1000 bytes" in assert_openai_error(refused, 413)["message"]
        assert httpx.post(server.url + CHAT, json=HI, timeout=60).status_code == 200
    finally:
        server.stop()


def test_allow_host_adds_names_to_the_loopback_ones(pair):
    from dflash_local.service.cli_serve import allowed_hosts

    args = argparse.Namespace(host="0.0.0.0", allow_host=["box.lan"])
    hosts = allowed_hosts(args)
    assert set(hosts) == {"localhost", "127.0.0.1", "::1", "box.lan"}
    assert "10.0.0.5" in allowed_hosts(argparse.Namespace(host="10.0.0.5", allow_host=[]))
    _state, server = start_service(*pair, app_options={"allowed_hosts": hosts})
    try:
        for host, status in (("box.lan:8000", 200), ("localhost", 200), ("[::1]:80", 200),
                             ("other.lan", 400), ("box.lan.evil.example", 400)):
            response = httpx.get(server.url + "/health", headers={"Host": host})
            assert response.status_code == status, (host, response.text)
    finally:
        server.stop()
