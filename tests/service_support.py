"""Shared by the service tests: a tiny random pair, the real server in a thread, a local hub.

The local hub is a stdlib HTTP server speaking the part of the Hugging Face hub API that
huggingface_hub's `snapshot_download` uses (repo info, tree listing, HEAD/GET resolve with Range),
so downloads run through the real huggingface_hub code path without network access.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: spinning OpenMP threads starve the server

import hashlib
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Self

import torch
from tiny_models import make_drafter, make_target

TARGET_INIT_STD = 0.15  # makes greedy output depend on the prompt (the tiny_models default is 0.08)


def make_pair(root: Path, seed: int = 0) -> tuple[Path, Path]:
    """A tiny random Qwen3 target (init std 0.15) and a z-lab-format drafter for it."""
    from transformers import AutoModelForCausalLM

    target = make_target(root / "target", seed=seed)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, TARGET_INIT_STD)
    model.save_pretrained(target)
    drafter = make_drafter(root / "drafter", target, seed=seed + 1, block_size=8)
    return target, drafter


def torch_loader(engine: str, target: str, drafter: str | None, _options=None):
    """The service's loader for tests: a TorchEngine on local directories."""
    from dflash_local.engines.torch_engine import TorchEngine

    assert engine == "transformers", engine
    return TorchEngine(Path(target), Path(drafter) if drafter else None,
                       target_name=str(target), drafter_name=str(drafter))


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.02):
    """Poll `predicate` until it returns a truthy value; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


# --- a local hub ---

ROUTE = re.compile(r"^/(?:api/models/)?(?P<repo>[^/]+/[^/]+)/(?P<kind>revision|tree|resolve)/"
                   r"(?P<rev>[^/?]+)(?:/(?P<file>[^?]*))?")


class LocalHub:
    """Serves directories as hub repos. `hold_after` bytes into a large file, a GET waits for
    `release` (so a test can cancel a download that is provably mid-file)."""

    def __init__(self, repos: dict[str, Path], hold_after: int | None = None):
        self.repos = {repo: Path(path) for repo, path in repos.items()}
        self.commits = {repo: hashlib.sha1(repo.encode()).hexdigest() for repo in repos}
        self.hold_after = hold_after
        self.release = threading.Event()
        self.holding = threading.Event()  # set while a GET is held
        self.requests: list[tuple[str, str]] = []  # (method, path) as received
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    def files(self, repo: str) -> dict[str, Path]:
        root = self.repos[repo]
        return {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file()}

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                self._serve(body=False)

            def do_GET(self):
                self._serve(body=True)

            def _serve(self, body: bool):
                hub.requests.append((self.command, self.path))
                match = ROUTE.match(self.path)
                if not match or match["repo"] not in hub.repos:
                    return self._error(404, "RepoNotFound", "Repository not found")
                repo, kind = match["repo"], match["kind"]
                if kind == "revision":
                    return self._json({"id": repo, "sha": hub.commits[repo], "private": False,
                                       "siblings": [{"rfilename": f} for f in hub.files(repo)]})
                if kind == "tree":
                    return self._json([_tree_entry(name, path) for name, path in hub.files(repo).items()])
                path = hub.files(repo).get(match["file"] or "")
                if path is None:
                    return self._error(404, "EntryNotFound", "Entry not found")
                self._file(repo, path, body)

            def _file(self, repo: str, path: Path, body: bool):
                data = path.read_bytes()
                start = int(re.match(r"bytes=(\d+)-", self.headers.get("Range", "bytes=0-"))[1])
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", hub.commits[repo])
                self.send_header("ETag", f'"{_etag(path)}"')
                self.send_header("Content-Length", str(len(data) - start))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                if not body:
                    return
                payload = data[start:]
                if hub.hold_after is not None and len(payload) > hub.hold_after and not hub.release.is_set():
                    self.wfile.write(payload[: hub.hold_after])
                    self.wfile.flush()
                    hub.holding.set()
                    hub.release.wait(60)
                    payload = payload[hub.hold_after:]
                try:
                    self.wfile.write(payload)
                except OSError:
                    pass  # the client cancelled

            def _json(self, value):
                data = json.dumps(value).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _error(self, status: int, code: str, message: str):
                data = json.dumps({"error": message}).encode()
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", message)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler


def _etag(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tree_entry(name: str, path: Path) -> dict:
    size = path.stat().st_size
    entry = {"type": "file", "path": name, "size": size,
             "oid": hashlib.sha1(path.read_bytes()).hexdigest()}
    if name.endswith(".safetensors"):
        entry["lfs"] = {"oid": _etag(path), "size": size, "pointerSize": 134}
    return entry


# --- the real server around a tiny pair ---

def start_service(target: Path, drafter: Path | None, app_options: dict | None = None,
                  **state_options):
    """A ServiceState with the tiny pair loaded, served by uvicorn on a free loopback port
    (`app_options`: create_app's allowed hosts and body limit)."""
    from dflash_local.service.app import create_app
    from dflash_local.service.server import BackgroundServer
    from dflash_local.service.state import ServiceState

    state = ServiceState(loader=torch_loader, **state_options)
    state.load("transformers", target, drafter, served_name="tiny", aliases=("tiny-target",))
    return state, BackgroundServer(create_app(state, **(app_options or {}))).start()


LONG_PROMPT = "Tell me a long story."  # make_pair's tiny pair runs past 900 tokens on it
EOS_PROMPT = "Count slowly."  # ...and ends its turn after 7 tokens on this one


def serve_module(tmp_path_factory, pair: tuple[Path, Path | None] | None = None, **state_options):
    """A module fixture's body: `yield from` it. A real service on a tiny pair (make_pair's
    unless `pair` = (target, drafter)), yielded as (state, server), stopped after the module."""
    target, drafter = pair or make_pair(tmp_path_factory.mktemp("pair"))
    state, server = start_service(target, drafter, hub_cache_dir=tmp_path_factory.mktemp("hub"),
                                  **state_options)
    try:
        yield state, server
    finally:
        server.stop()


def openai_client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def assert_openai_error(response, status: int, code: str | None = None) -> dict:
    """An OpenAI-style error body with the expected status (and code), never a traceback."""
    assert response.status_code == status, (response.status_code, response.text)
    assert "Traceback" not in response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    if code is not None:
        assert error["code"] == code, error
    return error
