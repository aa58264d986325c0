"""aider, the eleventh client, driven as its docs run it against an OpenAI-compatible endpoint
(`--message`, non-interactive), streaming one reply from the embedded pair served on 127.0.0.1.
aider renders its own prompt (its system prompt, its edit format's examples), so the test records
the request it actually sent and the stream it got back: the streamed text equals the service's
plain decoding of that same request, and is what aider printed.

aider-chat pins every requirement exactly: it lives in scripts/setup_aider.sh's venv (DFLASH_AIDER
names another aider) and this module skips without it. Not part of scripts/run-tests.sh.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest
from client_harness import API_KEY, REPO, RUN_TIMEOUT_S, serve_embedded

AIDER_ENV = "DFLASH_AIDER"
PROMPT = "Name three colours of the rainbow."
MAX_TOKENS = 80
CHAT_PATH = "/v1/chat/completions"


def aider_command() -> Path | None:
    named = os.environ.get(AIDER_ENV)
    if named:
        return Path(named)
    default = REPO / ".venv-aider" / "bin" / "aider"
    return default if default.is_file() else None


pytestmark = pytest.mark.skipif(
    aider_command() is None, reason=f"run scripts/setup_aider.sh (or set {AIDER_ENV})")


class ChatRecorder:
    """ASGI middleware keeping each chat request's JSON body and its raw response body, so the
    test can replay exactly what the client sent."""

    def __init__(self, app):
        self.app = app
        self.exchanges: list[tuple[dict, bytes]] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != CHAT_PATH:
            return await self.app(scope, receive, send)
        request_chunks: list[bytes] = []
        response_chunks: list[bytes] = []

        async def recording_receive():
            message = await receive()
            request_chunks.append(message.get("body", b""))
            return message

        async def recording_send(message):
            if message["type"] == "http.response.body":
                response_chunks.append(message.get("body", b""))
            await send(message)

        await self.app(scope, recording_receive, recording_send)
        self.exchanges.append((json.loads(b"".join(request_chunks)), b"".join(response_chunks)))


@pytest.fixture(scope="module")
def recorded_service(tmp_path_factory, embedded_target_dir):
    recorders: list[ChatRecorder] = []

    def wrap(app):
        recorders.append(ChatRecorder(app))
        return recorders[0]

    for _state, server in serve_embedded(tmp_path_factory, embedded_target_dir, wrap):
        yield server, recorders[0]


def streamed_deltas(response_body: bytes) -> list[str]:
    """The content pieces of an OpenAI chat SSE stream."""
    pieces = []
    for line in response_body.decode().splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[len("data: "):]).get("choices", []):
            pieces.append(choice.get("delta", {}).get("content") or "")
    return [piece for piece in pieces if piece]


def run_aider(base_url: str, home: Path) -> str:
    """aider's stdout for one non-interactive message; its model settings cap the reply."""
    work_dir = home / "project"
    work_dir.mkdir()
    # an empty, fresh model-price cache: aider fetches litellm's price list from GitHub otherwise
    price_cache = home / ".aider" / "caches" / "model_prices_and_context_window.json"
    price_cache.parent.mkdir(parents=True)
    price_cache.write_text("{}")
    settings = home / "model-settings.yml"
    settings.write_text(f"- name: openai/embedded\n  extra_params:\n    max_tokens: {MAX_TOKENS}\n")
    args = [str(aider_command()), "--model", "openai/embedded", "--message", PROMPT, "--yes",
            "--no-git", "--no-auto-commits", "--no-show-model-warnings", "--no-check-update",
            "--no-analytics", "--no-pretty", "--no-show-release-notes", "--map-tokens", "0",
            "--model-settings-file", str(settings)]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
           "OPENAI_API_BASE": base_url + "/v1", "OPENAI_API_KEY": API_KEY,
           "LITELLM_LOCAL_MODEL_COST_MAP": "True", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(args, env=env, cwd=work_dir, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, check=False)
    assert done.returncode == 0, f"aider exited {done.returncode}:\n{done.stderr[-4000:]}"
    return done.stdout


def test_aider_streams_the_plain_reply_to_the_request_it_made(recorded_service, tmp_path):
    server, recorder = recorded_service
    printed = run_aider(server.url, tmp_path)
    assert len(recorder.exchanges) == 1, [body.get("messages") for body, _ in recorder.exchanges]
    request, response_body = recorder.exchanges[0]
    assert request["stream"] is True
    pieces = streamed_deltas(response_body)
    assert len(pieces) > 1, response_body[-2000:]  # streamed, not one body

    replay = {**request, "stream": False, "speculative": False}
    replay.pop("stream_options", None)
    plain = httpx.post(server.url + CHAT_PATH, json=replay, timeout=120,
                       headers={"Authorization": f"Bearer {API_KEY}"})
    assert plain.status_code == 200, plain.text
    plain_text = plain.json()["choices"][0]["message"]["content"]
    assert "".join(pieces) == plain_text
    assert plain_text.strip() in printed
