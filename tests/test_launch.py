"""`dflash-local launch`'s decisions without the agents: which pairs may serve each client, the
refusals and what they name, and the environment and overrides that point each client at the
service (the real clients: scripts/agent_clients.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib

import pytest

from dflash_local.cli import launch
from dflash_local.cli.agent_clients import (
    API_KEY_ENV,
    CLIENTS,
    WORK_ROOM_TOKENS,
    Service,
    check_loaded,
    pair_context,
    pairs_that_serve,
    why_pair_cannot_serve,
)
from dflash_local.cli.main import build_parser, main
from dflash_local.errors import DFlashError, InvalidRequestError
from dflash_local.pairs.catalog import load_catalog

SERVICE = Service(url="http://127.0.0.1:4321", api_key="k3y", model="qwen3-8b", max_context=40960)


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_the_embedded_pair_is_refused_naming_pairs_that_can_serve(catalog, client):
    agent = CLIENTS[client]
    with pytest.raises(InvalidRequestError) as refused:
        launch.choose_pair(catalog, agent, "embedded", frozenset({"transformers"}))
    message = str(refused.value)
    assert "'embedded' cannot serve" in message and "takes no tools" in message
    named = message.split("Pairs that can on transformers: ")[1].split(", ")
    assert named == [pair.id for pair in pairs_that_serve(catalog, agent, frozenset({"transformers"}))]
    assert "qwen3-8b" in named and "embedded" not in named
    for pair_id in named:  # each one named really can: tools, a local engine, the context
        pair = catalog.get(pair_id)
        assert "transformers" in pair.engines
        assert pair_context(pair) >= agent.prompt_tokens + WORK_ROOM_TOKENS


def test_pairs_without_a_local_engine_or_a_parsed_tool_format_are_refused(catalog):
    claude = CLIENTS["claude"]
    served_only = catalog.get("qwen3.5-4b")  # vllm and sglang: their server gets no tools from us
    assert "not on a local engine" in why_pair_cannot_serve(served_only, claude)
    gemma = next(pair for pair in catalog.pairs if pair.model_type == "gemma4")
    assert "takes no tools" in why_pair_cannot_serve(gemma, claude)
    assert why_pair_cannot_serve(catalog.get("qwen3-8b"), claude) is None
    # on a machine with MLX only, the Transformers pair is refused and the MLX ones are named
    with pytest.raises(InvalidRequestError, match="qwen3-8b-mlx-4bit"):
        launch.choose_pair(catalog, claude, "qwen3-8b", frozenset({"mlx"}))


def test_a_running_service_with_too_little_context_is_refused(catalog):
    codex = CLIENTS["codex"]
    with pytest.raises(InvalidRequestError, match=f"context of 8192 tokens is under the "
                                                  f"{codex.context_needed}"):
        check_loaded(codex, None, 8192, catalog)
    with pytest.raises(InvalidRequestError, match="'embedded' cannot serve codex"):
        check_loaded(codex, "embedded", 1 << 20, catalog)
    check_loaded(codex, None, codex.context_needed, catalog)  # a pair of the user's own: by context


def test_claude_is_pointed_by_its_environment_alone():
    pointing = CLIENTS["claude"].point(SERVICE)
    assert pointing.args == ()
    assert pointing.env["ANTHROPIC_BASE_URL"] == SERVICE.url  # the SDK adds /v1/messages
    assert pointing.env["ANTHROPIC_AUTH_TOKEN"] == "k3y"
    assert pointing.env["ANTHROPIC_MODEL"] == "qwen3-8b"


def test_codex_is_pointed_by_config_overrides_that_parse_as_toml():
    pointing = CLIENTS["codex"].point(SERVICE)
    assert pointing.args[::2] == ("-c",) * (len(pointing.args) // 2)
    overrides = {}
    for override in pointing.args[1::2]:  # codex parses each value as TOML
        key, _, value = override.partition("=")
        overrides[key] = tomllib.loads(f"value = {value}")["value"]
    provider = overrides["model_providers.dflash_local"]
    assert overrides["model_provider"] == "dflash_local" and overrides["model"] == "qwen3-8b"
    assert provider["base_url"] == "http://127.0.0.1:4321/v1"
    assert provider["wire_api"] == "responses" and provider["env_key"] == API_KEY_ENV
    assert overrides["model_context_window"] == 40960
    assert pointing.env == {API_KEY_ENV: "k3y"}  # the key travels in the environment only


def test_opencode_gets_an_inline_config_that_names_the_key_by_its_variable():
    pointing = CLIENTS["opencode"].point(SERVICE)
    config = json.loads(pointing.env["OPENCODE_CONFIG_CONTENT"])
    provider = config["provider"]["dflash_local"]
    assert config["model"] == "dflash_local/qwen3-8b"
    assert provider["options"] == {"baseURL": "http://127.0.0.1:4321/v1",
                                   "apiKey": "{env:DFLASH_LOCAL_API_KEY}"}
    assert provider["models"]["qwen3-8b"]["limit"]["context"] == 40960
    assert "k3y" not in pointing.env["OPENCODE_CONFIG_CONTENT"]
    assert pointing.env[API_KEY_ENV] == "k3y"


def test_arguments_after_the_double_dash_go_to_the_client():
    ours, theirs = launch.split_client_args(["launch", "codex", "--pair", "qwen3-8b", "--",
                                             "exec", "-c", "model=x", "--", "hello"])
    assert theirs == ["exec", "-c", "model=x", "--", "hello"]
    args = build_parser().parse_args(ours)
    assert (args.client, args.pair, args.client_args) == ("codex", "qwen3-8b", [])
    assert launch.split_client_args(["generate", "--", "-x"]) == (["generate", "--", "-x"], [])


def test_the_cli_refuses_before_starting_anything(monkeypatch, capsys, tmp_path):
    started = []
    monkeypatch.setattr(launch, "start_service", lambda *args: started.append(args))
    monkeypatch.setattr(launch.shutil, "which", lambda name: str(tmp_path / name))
    assert main(["launch", "claude", "--pair", "embedded"]) == 2
    assert "'embedded' cannot serve claude" in capsys.readouterr().err and not started
    monkeypatch.setattr(launch.shutil, "which", lambda name: None)
    assert main(["launch", "opencode", "--pair", "qwen3-8b"]) == 2
    assert "npm install -g opencode-ai" in capsys.readouterr().err


def test_the_client_is_execd_with_the_service_in_its_environment(monkeypatch, tmp_path):
    executed = {}
    monkeypatch.setattr(launch.shutil, "which", lambda name: str(tmp_path / name))
    monkeypatch.setattr(launch, "attach", lambda *args, **kwargs: SERVICE)
    monkeypatch.setattr(os, "execve", lambda path, argv, env: executed.update(
        path=path, argv=argv, env=env))
    main(["launch", "claude", "--server", "http://127.0.0.1:4321", "--", "-p", "hi"])
    assert executed["argv"] == [str(tmp_path / "claude"), "-p", "hi"]
    assert executed["env"]["ANTHROPIC_BASE_URL"] == SERVICE.url
    assert executed["env"]["PATH"] == os.environ["PATH"]  # the user's own environment, plus ours


def _fake_service(tmp_path, code: str):
    log_path = tmp_path / "service.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen([sys.executable, "-c", code], stdout=log,
                                   stderr=subprocess.STDOUT)
    return process, log_path


def test_the_service_url_is_read_from_its_serving_line(tmp_path, capsys):
    process, log_path = _fake_service(tmp_path, (
        "import sys; print('dflash-local loading qwen3-8b (its weights)', flush=True); "
        "print('dflash-local serving qwen3-8b on http://127.0.0.1:4321', flush=True); "
        "sys.stdin.read()"))
    try:
        assert launch._wait_serving(process, log_path) == "http://127.0.0.1:4321"
    finally:
        process.kill()
        process.wait()
    assert "dflash-local loading qwen3-8b" in capsys.readouterr().err  # its phases, shown


def test_a_service_that_ends_before_serving_is_reported_with_its_log(tmp_path):
    process, log_path = _fake_service(tmp_path, "print('error: no pair qwen9'); raise SystemExit(2)")
    with pytest.raises(DFlashError, match=r"ended \(exit 2\) before serving:\nerror: no pair qwen9"):
        launch._wait_serving(process, log_path)
