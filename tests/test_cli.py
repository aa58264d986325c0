"""`dflash-local generate` as a user runs it (a subprocess), on a tiny pair and on a tiny harmony
(gpt-oss format) target, and engine loading."""

from __future__ import annotations

import json
import os
import pty
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
from fixtures_tiny import collect, tiny_engine, tiny_pair
from harmony_tiny import GREETING, HELLO, PLAIN_REPLY, REASONING, harmony_pair

from dflash_local import engines
from dflash_local.cli.reply import DIM, NORMAL
from dflash_local.engines.options import EngineOptions
from dflash_local.errors import EngineUnavailableError
from dflash_local.events import GenerationParams

REPO = Path(__file__).resolve().parent.parent
PROMPT = "hello world"
JSON_KEYS = {"prompt_token_ids", "token_ids", "text", "accepted_per_round", "tau",
             "tokens_per_second", "engine", "block_size", "target_path", "drafter_path"}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory, "qwen3")


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory):
    home = tmp_path_factory.mktemp("cli-home")
    python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": python_path, "HF_HOME": str(home / "hf"),
            "HF_HUB_OFFLINE": "1", "DFLASH_LOCAL_HOME": str(home / "app"), "OMP_NUM_THREADS": "1"}


def cli(env, *args, timeout=180) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "dflash_local.cli.main", *args], env=env,
                            capture_output=True, timeout=timeout, cwd=REPO, check=False)
    # decoded by hand: text mode would turn a generated "\r" into "\n"
    result.stdout, result.stderr = result.stdout.decode(), result.stderr.decode()
    return result


def plain_tokens(pair, prompt_ids, max_tokens):
    engine = tiny_engine(pair)
    params = GenerationParams(max_tokens=max_tokens, speculative=False)
    tokens, _ = collect(engine.stream(prompt_ids, params))
    return tokens


def test_generate_json_equals_plain(pair, cli_env):
    result = cli(cli_env, "generate", "--json", "--target", str(pair.target), "--drafter",
                 str(pair.drafter), "--block-size", "4", "--max-tokens", "16", PROMPT)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert JSON_KEYS <= set(report)
    engine = tiny_engine(pair)
    assert report["prompt_token_ids"] == engine.encode_chat([{"role": "user", "content": PROMPT}])
    assert report["token_ids"] == plain_tokens(pair, report["prompt_token_ids"], 16)
    assert sum(report["accepted_per_round"]) == len(report["token_ids"]) - 1
    rounds = report["accepted_per_round"]
    assert report["tau"] == pytest.approx(sum(rounds) / len(rounds))
    assert report["text"] == engine.decode(report["token_ids"])
    assert (report["engine"], report["block_size"]) == ("transformers", 4)
    assert report["target_path"] == str(pair.target.resolve())
    assert report["drafter_path"] == str(pair.drafter.resolve())


def test_generate_json_reports_logprobs_when_asked(pair, cli_env):
    result = cli(cli_env, "generate", "--json", "--target", str(pair.target), "--drafter",
                 str(pair.drafter), "--block-size", "4", "--max-tokens", "8", "--logprobs", "3",
                 PROMPT)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert len(report["logprobs"]) == len(report["token_ids"]) == 8
    for token_id, entry in zip(report["token_ids"], report["logprobs"]):
        assert len(entry["top"]) == 3 and entry["top"][0] == [token_id, entry["logprob"]]  # greedy
    refused = cli(cli_env, "generate", "--json", "--target", str(pair.target), "--logprobs", "21",
                  "--no-speculative", PROMPT)
    assert refused.returncode == 2
    assert "logprobs (top alternatives) must be an integer in [0, 20], got 21" in refused.stderr


def test_generate_with_auto_calibrates_at_load_as_a_visible_phase_then_reads_the_cache(
        pair, tmp_path, cli_env):
    env = {**cli_env, "DFLASH_LOCAL_HOME": str(tmp_path / "app")}  # no calibration cached yet
    args = ("generate", "--json", "--target", str(pair.target), "--drafter", str(pair.drafter),
            "--block-size", "auto", "--max-tokens", "12", PROMPT)
    first, second = cli(env, *args), cli(env, *args)
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr
    assert "dflash-local calibrating" in first.stderr  # said before the wait, not after
    assert "calibrating" not in second.stderr  # measured once per machine and pair
    assert len(list((tmp_path / "app").rglob("calibration/*.json"))) == 1
    engine = tiny_engine(pair)
    report = json.loads(second.stdout)
    assert report["token_ids"] == plain_tokens(pair, report["prompt_token_ids"], 12)
    assert report["block_size"] == engine.pair.drafter_block  # auto: up to the drafter's block


def test_raw_prompt_skips_the_chat_template(pair, cli_env):
    result = cli(cli_env, "generate", "--json", "--raw", "--no-speculative", "--target",
                 str(pair.target), "--max-tokens", "8", PROMPT)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    engine = tiny_engine(pair)
    assert report["prompt_token_ids"] == engine.encode_raw(PROMPT)
    assert report["prompt_token_ids"] != engine.encode_chat([{"role": "user", "content": PROMPT}])
    assert report["token_ids"] == plain_tokens(pair, report["prompt_token_ids"], 8)
    assert report["block_size"] == 1 and report["drafter_path"] is None
    assert "warning" not in result.stderr  # --no-speculative: no drafter is expected


def test_text_streams_to_stdout(pair, cli_env):
    result = cli(cli_env, "generate", "--target", str(pair.target), "--drafter", str(pair.drafter),
                 "--max-tokens", "12", PROMPT)
    assert result.returncode == 0, result.stderr
    engine = tiny_engine(pair)
    expected = plain_tokens(pair, engine.encode_chat([{"role": "user", "content": PROMPT}]), 12)
    assert result.stdout == engine.decode(expected) + "\n"
    assert "tau" in result.stderr  # the stats line goes to stderr, never into the text


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    return harmony_pair(tmp_path_factory)


def test_a_harmony_reply_prints_its_answer_on_stdout_and_its_reasoning_on_stderr(harmony, cli_env):
    flags = ("generate", "--target", str(harmony.target), "--drafter", str(harmony.drafter),
             "--block-size", "4", "--max-tokens", "64", GREETING)  # fixed: no calibration line
    result = cli(cli_env, *flags)
    assert result.returncode == 0, result.stderr
    assert result.stdout == HELLO + "\n"  # the final channel alone, no markers
    assert result.stderr.startswith(REASONING + "\n") and "tau" in result.stderr
    reader, writer = pty.openpty()  # stderr on a terminal: the reasoning is dimmed
    try:
        run = subprocess.run([sys.executable, "-m", "dflash_local.cli.main", *flags], env=cli_env,
                             stdout=subprocess.PIPE, stderr=writer, timeout=180, cwd=REPO,
                             check=False)
        os.close(writer)
        terminal = read_terminal(reader)
    finally:
        os.close(reader)
    assert run.returncode == 0 and run.stdout.decode() == HELLO + "\n"
    assert terminal.startswith(f"{DIM}{REASONING}{NORMAL}\r\n"), terminal


def read_terminal(reader: int) -> str:
    """All a pty got once its writers are gone (Linux then answers EIO)."""
    chunks = []
    while True:
        try:
            chunk = os.read(reader, 4096)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode()


def test_a_harmony_replys_json_carries_its_reasoning_beside_the_text(harmony, pair, cli_env):
    result = cli(cli_env, "generate", "--json", "--target", str(harmony.target), "--drafter",
                 str(harmony.drafter), "--max-tokens", "64", GREETING)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["text"], report["reasoning_content"]) == (HELLO, REASONING)
    engine = tiny_engine(harmony)
    assert report["token_ids"] == plain_tokens(harmony, report["prompt_token_ids"], 64)
    assert engine.tokenizer.decode(report["token_ids"]) == PLAIN_REPLY  # every channel's tokens
    plain = cli(cli_env, "generate", "--json", "--target", str(pair.target), "--max-tokens", "4",
                "--no-speculative", PROMPT)
    assert json.loads(plain.stdout)["reasoning_content"] is None  # no reasoning channel


def assert_one_line_error(result, *fragments):
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


def test_unknown_repo_offline(cli_env):
    result = cli(cli_env, "generate", "--no-speculative", "--target", "nobody/no-such-model",
                 PROMPT)
    assert_one_line_error(result, "nobody/no-such-model", "offline")


@pytest.mark.parametrize("flags", [("--no-load",), ("--engine", "vllm")])
def test_serve_refuses_recalibrate_without_a_local_pair_to_load(cli_env, flags):
    result = cli(cli_env, "serve", "--recalibrate", *flags)
    assert_one_line_error(result, "--recalibrate", "POST /dflash/load")


def test_serve_refuses_max_batch_zero(cli_env):
    result = cli(cli_env, "serve", "--no-load", "--max-batch", "0")
    assert_one_line_error(result, "--max-batch must be >= 1, got 0")


def test_serve_refuses_a_max_batch_memory_cannot_hold(pair, cli_env):
    result = cli(cli_env, "serve", "--target", str(pair.target), "--drafter", str(pair.drafter),
                 "--engine", "transformers", "--max-batch", "100000000")
    assert_one_line_error(result, "--max-batch 100000000", "more than this machine's memory of")


def test_incompatible_pair_names_the_check(pair, cli_env, tmp_path):
    drafter = shutil.copytree(pair.drafter, tmp_path / "drafter")
    config = json.loads((drafter / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [1, 9]
    (drafter / "config.json").write_text(json.dumps(config))
    result = cli(cli_env, "generate", "--target", str(pair.target), "--drafter", str(drafter),
                 PROMPT)
    assert_one_line_error(result, "drafter tap 9 >= target layers 6")


def test_truncated_drafter(pair, cli_env, tmp_path):
    drafter = shutil.copytree(pair.drafter, tmp_path / "drafter")
    weights = drafter / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    result = cli(cli_env, "generate", "--target", str(pair.target), "--drafter", str(drafter),
                 PROMPT)
    assert_one_line_error(result, "truncated or corrupt")


def test_no_target_and_no_embedded_import(cli_env):
    result = cli(cli_env, "generate", PROMPT)
    assert_one_line_error(result, "dflash-local models import-embedded")


def test_bad_parameter(pair, cli_env):
    result = cli(cli_env, "generate", "--target", str(pair.target), "--top-p", "0", PROMPT)
    assert_one_line_error(result, "top_p must be in (0, 1], got 0.0")


# --- engine loading, in process ---

def test_auto_picks_transformers_when_torch_is_installed():
    assert engines.choose_engine() == "transformers"


def test_missing_package_names_the_extra(monkeypatch, pair):
    real_find_spec = engines.importlib.util.find_spec
    monkeypatch.setattr(engines.importlib.util, "find_spec",
                        lambda name: None if name == "torch" else real_find_spec(name))
    hint = r"needs torch.*pip install 'dflash-local\[torch\]'"
    with pytest.raises(EngineUnavailableError, match=hint):
        engines.load_engine("transformers", str(pair.target), None)


def test_unknown_engine():
    with pytest.raises(EngineUnavailableError, match="unknown engine 'vulkan'"):
        engines.load_engine("vulkan", "x", None)


def test_mlx_is_wired_lazily(monkeypatch, pair):
    made = {}

    class MLXEngine:
        def __init__(self, target_path, drafter_path, **kwargs):
            made.update(target_path=target_path, drafter_path=drafter_path, **kwargs)

    fake = types.ModuleType("dflash_local.engines.mlx_engine")
    fake.MLXEngine = MLXEngine
    monkeypatch.setitem(sys.modules, "dflash_local.engines.mlx_engine", fake)
    monkeypatch.setattr(engines, "_missing_packages", lambda spec: [])
    engines.load_engine("mlx", str(pair.target), str(pair.drafter), EngineOptions(dtype="bfloat16"))
    assert made == {"target_path": pair.target.resolve(), "drafter_path": pair.drafter.resolve(),
                    "target_name": str(pair.target), "drafter_name": str(pair.drafter),
                    "dtype": "bfloat16"}


# --- the default pair and `models import-embedded`, in process ---

def fake_embedded_import(monkeypatch, tmp_path) -> Path:
    from dflash_local.pairs import embedded

    target = tmp_path / "embedded-target"
    target.mkdir()
    (target / embedded.MARKER_NAME).write_text("{}")
    monkeypatch.setattr(embedded, "embedded_target_dir", lambda: target)
    return target


def test_default_pair_is_the_embedded_one(monkeypatch, tmp_path, capsys):
    from dflash_local import paths
    from dflash_local.cli import main as cli_module

    target = fake_embedded_import(monkeypatch, tmp_path)
    shipped = tmp_path / "models"
    monkeypatch.setattr(paths, "shipped_models_dir", lambda: shipped)
    assert cli_module.pair_names(None, None, speculative=True) == (str(target), None)
    assert "embedded drafter is not in" in capsys.readouterr().err
    drafter = shipped / cli_module.EMBEDDED_DRAFTER_DIR
    drafter.mkdir(parents=True)
    (drafter / "config.json").write_text("{}")
    assert cli_module.pair_names(None, None, speculative=True) == (str(target), str(drafter))
    assert cli_module.pair_names(None, "other/drafter", speculative=True) == (str(target),
                                                                              "other/drafter")


def test_models_import_embedded(monkeypatch, tmp_path, capsys):
    from dflash_local.cli import main as cli_module
    from dflash_local.errors import CheckpointError
    from dflash_local.pairs import embedded

    calls = []
    monkeypatch.setattr(embedded, "import_embedded",
                        lambda **kwargs: calls.append(kwargs) or tmp_path / "done")
    assert cli_module.main(["models", "import-embedded", "--dtype", "bfloat16"]) == 0
    assert calls == [{"dtype": "bfloat16", "force": False}]
    assert str(tmp_path / "done") in capsys.readouterr().out

    def broken(**kwargs):
        raise CheckpointError("the GGUF is truncated\n(read 10 of 20 bytes)")

    monkeypatch.setattr(embedded, "import_embedded", broken)
    assert cli_module.main(["models", "import-embedded"]) == 2
    assert capsys.readouterr().err == "error: the GGUF is truncated (read 10 of 20 bytes)\n"
