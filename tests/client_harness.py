"""The Python clients' harness: a pair served on 127.0.0.1 by the real service, and client
snippets run as subprocesses in the clients' own venv (scripts/setup_clients.sh), their stdout
handed back. The clients' pins never meet ours: only HTTP crosses between the two venvs.

A snippet reads where to go from its environment (`ClientRunner.env`): OPENAI_BASE_URL,
ANTHROPIC_BASE_URL, DFLASH_BASE_URL (the root, no /v1), DFLASH_MODEL (the served name) and a
key; it prints what the test compares. The venv is DFLASH_CLIENTS_PYTHON's interpreter, else
.venv-clients in the repo; without either, the tests that need it skip.
"""

from __future__ import annotations

import os
import subprocess
import textwrap
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
CLIENTS_PYTHON_ENV = "DFLASH_CLIENTS_PYTHON"
API_KEY = "dflash-clients-test"
RUN_TIMEOUT_S = 180  # a client's import alone takes seconds on a busy 2-core machine


def clients_python() -> Path | None:
    """The clients' interpreter: DFLASH_CLIENTS_PYTHON, else the repo's .venv-clients."""
    named = os.environ.get(CLIENTS_PYTHON_ENV)
    if named:
        return Path(named)
    default = REPO / ".venv-clients" / "bin" / "python"
    return default if default.is_file() else None


requires_clients = pytest.mark.skipif(
    clients_python() is None,
    reason=f"run scripts/setup_clients.sh (or set {CLIENTS_PYTHON_ENV}) for the client tests")


@dataclass(frozen=True)
class ClientRunner:
    """Runs client snippets against one served pair. `home` is the clients' HOME (llm keeps its
    keys and logs there), so no run reads or writes the user's own configuration."""

    python: Path
    base_url: str
    model: str
    home: Path

    def env(self, **extra: str) -> dict[str, str]:
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.home),
            "LLM_USER_PATH": str(self.home / "llm"),
            "OPENAI_BASE_URL": self.base_url + "/v1", "OPENAI_API_KEY": API_KEY,
            "ANTHROPIC_BASE_URL": self.base_url, "ANTHROPIC_API_KEY": API_KEY,
            "DFLASH_BASE_URL": self.base_url, "DFLASH_MODEL": self.model,
            # no fetch of litellm's price list, no traces shipped by openai-agents
            "LITELLM_LOCAL_MODEL_COST_MAP": "True", "OPENAI_AGENTS_DISABLE_TRACING": "1",
            "PYTHONUNBUFFERED": "1", **extra}

    def run(self, snippet: str, timeout: float = RUN_TIMEOUT_S, **env: str) -> str:
        """The snippet's stdout; a failed run fails the test with the end of its stderr."""
        return self.run_argv(["-c", textwrap.dedent(snippet)], timeout, **env)

    def run_argv(self, args: list[str], timeout: float = RUN_TIMEOUT_S, **env: str) -> str:
        """The venv's python with these arguments (`-m llm ...`), its stdout."""
        done = subprocess.run([str(self.python), *args], env=self.env(**env), capture_output=True,
                              text=True, timeout=timeout, cwd=self.home, check=False)
        if done.returncode != 0:
            raise AssertionError(f"client run exited {done.returncode}:\n{done.stderr[-4000:]}")
        return done.stdout

    def plain_reply(self, messages: list[dict], max_tokens: int, **fields) -> str:
        """The service's own plain decoding (no drafter) of a chat request: what a client's
        greedy reply must equal, token for token."""
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens,
                "speculative": False, **fields}
        response = httpx.post(self.base_url + "/v1/chat/completions", json=body,
                              headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)
        response.raise_for_status()
        return response.json()["choices"][0]["message"]["content"]


def serve_embedded(tmp_path_factory, target_dir: Path, wrap_app=None):
    """A module fixture's body (`yield from` it): the embedded pair (its target and the shipped
    drafter) served with a key on 127.0.0.1, as (state, server), stopped after the module.
    `wrap_app` (an ASGI middleware's constructor) sees every request, for a test that records
    what a client sent."""
    from service_support import torch_loader

    from dflash_local import paths
    from dflash_local.events import WHOLE_BLOCK
    from dflash_local.pairs.default_pair import EMBEDDED_DRAFTER_DIR
    from dflash_local.service.app import create_app
    from dflash_local.service.server import BackgroundServer
    from dflash_local.service.state import ServiceState

    drafter = paths.shipped_models_dir() / EMBEDDED_DRAFTER_DIR
    state = ServiceState(loader=torch_loader, api_key=API_KEY,
                         hub_cache_dir=tmp_path_factory.mktemp("hub"))
    # a fixed block: the auto planner's calibration would cost the module seconds for nothing
    state.load("transformers", target_dir, drafter, served_name="embedded", pair_id="embedded",
               block_size=WHOLE_BLOCK, aliases=("SmolLM2-135M-Instruct",))
    app = create_app(state)
    server = BackgroundServer(wrap_app(app) if wrap_app else app).start()
    try:
        yield state, server
    finally:
        server.stop()


def client_runner(server, tmp_path_factory, model: str = "embedded") -> ClientRunner:
    python = clients_python()
    if python is None:
        pytest.skip(f"run scripts/setup_clients.sh (or set {CLIENTS_PYTHON_ENV})")
    return ClientRunner(python, server.url, model, tmp_path_factory.mktemp("client_home"))
