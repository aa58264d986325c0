"""vLLM/SGLang launchers without the packages: the command lines and environments each catalog pair
gets (checked against the flags table and the z-lab README's own launch commands), version checks,
a missing package, and a fake server that never becomes healthy (clear error, nothing left behind).
Plus `--engine auto` on synthetic machines.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from dflash_local.engines import server_flags
from dflash_local.engines.launch import ServerProcess, installed_distribution
from dflash_local.engines.selection import PlatformInfo, choose_engine, preference
from dflash_local.engines.server_flags import (
    FLAG_TABLE,
    LaunchSpec,
    entry_for,
    sglang_args,
    vllm_args,
)
from dflash_local.engines.sglang_engine import SGLangEngine
from dflash_local.engines.vllm_engine import VLLMEngine
from dflash_local.errors import EngineUnavailableError
from dflash_local.pairs.catalog import load_catalog

# The z-lab/dflash README's Quick Start, verbatim (the launch commands we must agree with).
ZLAB_VLLM = """vllm serve Qwen/Qwen3.5-27B \
  --speculative-config '{"method": "dflash", "model": "z-lab/Qwen3.5-27B-DFlash", "num_speculative_tokens": 15}' \
  --attention-backend flash_attn --max-num-batched-tokens 32768"""
ZLAB_SGLANG = """python -m sglang.launch_server --model-path Qwen/Qwen3.5-35B-A3B \
    --speculative-algorithm DFLASH --speculative-draft-model-path z-lab/Qwen3.5-35B-A3B-DFlash \
    --speculative-num-draft-tokens 16 --tp-size 1"""
ZLAB_SGLANG_ENV = {"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"}
NEWEST = {"vllm": "0.32.0", "sglang": "0.5.23"}


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def served_pairs():
    return [(pair, engine) for pair in load_catalog().pairs for engine in ("vllm", "sglang")
            if engine in pair.engines]


# --- the flags table ---

def test_every_entry_cites_the_file_and_release_it_was_read_from():
    for entry in FLAG_TABLE:
        repo = {"vllm": "vllm-project/vllm", "sglang": "sgl-project/sglang"}[entry.server]
        match = re.match(rf"{repo} v(\d+\.\d+\.\d+): \S+\.py", entry.source)
        assert match, entry.source
        assert server_flags.parse_version(match.group(1)) == entry.since, entry
    for server in ("vllm", "sglang"):
        since = [entry.since for entry in FLAG_TABLE if entry.server == server]
        assert since == sorted(since) and len(set(since)) == len(since)


@pytest.mark.parametrize(("pair", "engine"), served_pairs(), ids=lambda v: getattr(v, "id", v))
def test_each_catalog_pair_gets_the_tables_flags(pair, engine):
    block = pair.block_size_for(engine)
    spec = LaunchSpec(target=pair.target.repo, drafter=pair.drafter.repo, block_size=block, port=8123)
    if engine == "vllm":
        argv, env = vllm_args(spec, NEWEST["vllm"])
        assert argv[:4] == ["-m", "vllm.entrypoints.cli.main", "serve", pair.target.repo]
        assert env == {}
        assert json.loads(flag(argv, "--speculative-config")) == {
            "method": "dflash", "model": pair.drafter.repo, "num_speculative_tokens": block - 1}
        assert flag(argv, "--attention-backend") == server_flags.VLLM_DRAFT_ATTENTION
    else:
        argv, env = sglang_args(spec, NEWEST["sglang"])
        assert argv[:2] == ["-m", "sglang.launch_server"]
        assert flag(argv, "--model-path") == pair.target.repo
        assert flag(argv, "--speculative-algorithm") == "DFLASH"
        assert flag(argv, "--speculative-draft-model-path") == pair.drafter.repo
        assert flag(argv, "--speculative-num-draft-tokens") == str(block)
        assert env == server_flags.SGLANG_BASE_ENV
    assert flag(argv, "--port") == "8123" and flag(argv, "--host") == "127.0.0.1"
    # usage.prompt_tokens_details.cached_tokens, which the served engine relays
    assert (server_flags.VLLM_CACHE_REPORT if engine == "vllm"
            else server_flags.SGLANG_CACHE_REPORT) in argv


def test_flags_agree_with_the_zlab_readme_launch_commands():
    readme = shlex.split(ZLAB_VLLM)
    ours, _ = vllm_args(LaunchSpec("Qwen/Qwen3.5-27B", "z-lab/Qwen3.5-27B-DFlash", 16), "0.32.0")
    assert ours[2:4] == readme[1:3]
    assert json.loads(flag(ours, "--speculative-config")) == json.loads(flag(readme, "--speculative-config"))
    assert flag(ours, "--attention-backend").lower() == flag(readme, "--attention-backend")
    readme = shlex.split(ZLAB_SGLANG)
    ours, env = sglang_args(LaunchSpec("Qwen/Qwen3.5-35B-A3B", "z-lab/Qwen3.5-35B-A3B-DFlash", 16),
                            "0.5.23")
    assert ours[:2] == readme[1:3]
    for name in ("--model-path", "--speculative-algorithm", "--speculative-draft-model-path",
                 "--speculative-num-draft-tokens"):
        assert flag(ours, name) == flag(readme, name), name
    assert env == ZLAB_SGLANG_ENV


def test_vllm_cpu_starts_through_the_api_server_module():
    argv, _ = vllm_args(LaunchSpec("/models/t", "/models/d", 8, cuda=False), "0.32.0", "vllm-cpu")
    assert argv[:4] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "/models/t"]
    assert "--attention-backend" not in argv


def test_a_plain_twin_has_no_speculation_flags():
    argv, _ = vllm_args(LaunchSpec("Qwen/Qwen3-8B", None, memory_share=0.42), "0.32.0")
    assert "--speculative-config" not in argv and flag(argv, "--gpu-memory-utilization") == "0.42"
    argv, env = sglang_args(LaunchSpec("Qwen/Qwen3-8B", None, memory_share=0.42), "0.5.23")
    assert "--speculative-algorithm" not in argv and env == {}
    assert server_flags.SGLANG_CACHE_REPORT in argv  # a twin reports its cache hits too
    assert flag(argv, "--mem-fraction-static") == "0.42"


@pytest.mark.parametrize(("version", "window_flag"), [
    ("0.5.11", "--speculative-dflash-draft-window-size"),
    ("0.5.12", "--speculative-draft-window-size"),
    ("0.5.23", "--speculative-draft-window-size"),
])
def test_sglang_draft_window_flag_follows_the_version(version, window_flag):
    argv, _ = sglang_args(LaunchSpec("t", "d", 16, draft_window=4096), version)
    assert flag(argv, window_flag) == "4096"


def test_sglang_schedule_overlap_env_only_where_dflash_has_spec_v2():
    with pytest.raises(EngineUnavailableError, match="0.5.14"):
        sglang_args(LaunchSpec("t", "d", 16, schedule_overlap=True), "0.5.13")
    _, env = sglang_args(LaunchSpec("t", "d", 16, schedule_overlap=True), "0.5.14")
    assert env["SGLANG_ENABLE_OVERLAP_PLAN_STREAM"] == "1"


@pytest.mark.parametrize(("server", "too_old", "first"), [("vllm", "0.19.0", "0.20.0"),
                                                          ("sglang", "0.5.10", "0.5.11")])
def test_versions_without_dflash_are_refused_with_the_reason(server, too_old, first):
    with pytest.raises(EngineUnavailableError, match=rf"{server} {too_old} has no DFlash.*{first}"):
        entry_for(server, too_old)
    assert entry_for(server, first).since == server_flags.parse_version(first)


@pytest.mark.parametrize(("server", "old", "needed"), [("vllm", "0.27.1", "0.28.0"),
                                                       ("sglang", "0.5.18", "0.5.19")])
def test_dflash2_drafters_need_a_newer_server(server, old, needed):
    build = vllm_args if server == "vllm" else sglang_args
    spec = LaunchSpec("t", "z-lab/X-DFlash2", 8, drafter_is_v2=True)
    with pytest.raises(EngineUnavailableError, match=f"needs {server} >= {needed}"):
        build(spec, old)
    build(spec, needed)


def test_a_dflash2_drafter_refusal_names_both_versions_and_the_source():
    spec = LaunchSpec("Qwen/Qwen3.8-27B", "z-lab/Qwen3.8-27B-DFlash2", 8, drafter_is_v2=True)
    with pytest.raises(EngineUnavailableError) as refused:
        vllm_args(spec, "0.27.1")
    message = str(refused.value)
    assert "vllm runs DFlash 2 drafters only from 0.28.0" in message
    assert "vllm-project/vllm v0.28.0: vllm/model_executor/models/qwen3_dflash2.py" in message
    assert "this server is vllm 0.27.1" in message
    with pytest.raises(EngineUnavailableError, match=r"only from 0\.5\.19 \(sgl-project/sglang "
                       r"v0\.5\.19: python/sglang/srt/models/dflash\.py\); this server is "
                       r"sglang 0\.5\.14"):
        sglang_args(spec, "0.5.14")


def test_vllm_runs_a_dflash2_drafter_on_its_v2_model_runner():
    v2 = LaunchSpec("Qwen/Qwen3.8-27B", "z-lab/Qwen3.8-27B-DFlash2", 8, drafter_is_v2=True)
    argv, env = vllm_args(v2, NEWEST["vllm"])
    assert env == {"VLLM_USE_V2_MODEL_RUNNER": "1"}  # on V1 it would draft as DFlash 1
    assert json.loads(flag(argv, "--speculative-config")) == {
        "method": "dflash", "model": "z-lab/Qwen3.8-27B-DFlash2", "num_speculative_tokens": 7}
    _, env = vllm_args(LaunchSpec("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16", 16), NEWEST["vllm"])
    assert env == {}
    _, env = sglang_args(v2, NEWEST["sglang"])
    assert env == server_flags.SGLANG_BASE_ENV


@pytest.mark.parametrize("engine_class", [VLLMEngine, SGLangEngine])
def test_the_catalogs_dflash2_mark_refuses_an_old_server_before_it_starts(engine_class):
    """The drafter's config is unreadable here (no hub): the catalog's version decides."""
    old = {"vllm": "0.27.1", "sglang": "0.5.18"}[engine_class.server]
    with pytest.raises(EngineUnavailableError, match=f"this server is {engine_class.server} {old}"):
        engine_class("Qwen/Qwen3.8-27B", "/nonexistent/Qwen3.8-27B-DFlash2", block_size=8,
                     server_version=old, drafter_version=2, server_python=sys.executable)


def test_dflash2_catalog_pairs_get_a_server_that_runs_them():
    for pair, engine in served_pairs():
        spec = LaunchSpec(pair.target.repo, pair.drafter.repo, pair.block_size_for(engine),
                          drafter_is_v2=pair.drafter_version == 2)
        (vllm_args if engine == "vllm" else sglang_args)(spec, NEWEST[engine])


@pytest.mark.parametrize(("text", "parsed"), [("0.32.0", (0, 32, 0)), ("0.5.15.post1", (0, 5, 15)),
                                              ("0.20.0+cu129", (0, 20, 0)),
                                              ("0.33.0rc1.dev5", (0, 33, 0))])
def test_release_strings_parse(text, parsed):
    assert server_flags.parse_version(text) == parsed


# --- missing packages ---

@pytest.mark.parametrize(("engine_class", "extra"), [(VLLMEngine, "vllm"), (SGLangEngine, "sglang")])
def test_a_missing_package_names_the_extra(engine_class, extra):
    if __import__("importlib").util.find_spec(extra) is not None:
        pytest.skip(f"{extra} is installed here")
    with pytest.raises(EngineUnavailableError, match=re.escape(f"pip install 'dflash-local[{extra}]'")):
        engine_class("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16")
    with pytest.raises(EngineUnavailableError, match=re.escape(f"dflash-local[{extra}]")):
        installed_distribution(extra)
    with pytest.raises(EngineUnavailableError, match=re.escape(f"in {sys.executable}: pip install")):
        installed_distribution(extra, python=sys.executable)  # a server venv of its own


# --- a fake server: never healthy ---

FAKE_SERVER = textwrap.dedent(f"""\
    #!{sys.executable}
    import subprocess, sys, time
    print("fake server argv:", " ".join(sys.argv[1:]), flush=True)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(f"fake server loading weights (child {{child.pid}})", flush=True)
    time.sleep(600)
""")


def drafter_dir(root: Path, block_size: int = 16) -> Path:
    """A drafter directory holding only z-lab's config.json (Qwen3-8B-DFlash-b16's shape)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 4096,
        "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "rope_theta": 1000000,
        "num_target_layers": 36, "dflash_config": {"target_layer_ids": [1, 9, 17, 25, 33],
                                                   "mask_token_id": 151669, "block_size": block_size},
    }))
    return root


def family_of(pid: int) -> list[psutil.Process]:
    try:
        parent = psutil.Process(pid)
        return [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def alive(pids) -> list[int]:
    return [pid for pid in pids if psutil.pid_exists(pid)
            and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize("engine_class", [VLLMEngine, SGLangEngine])
def test_a_server_that_never_gets_healthy_fails_clearly_and_leaves_nothing(tmp_path, engine_class):
    fake = tmp_path / "fake_python"  # stands in for a server venv's interpreter
    fake.write_text(FAKE_SERVER)
    fake.chmod(0o755)
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    started = time.monotonic()
    with pytest.raises(EngineUnavailableError) as failure:
        engine_class("Qwen/Qwen3-8B", drafter_dir(tmp_path / "drafter"), target_name="qwen3-8b",
                     server_python=str(fake), server_version=NEWEST[engine_class.server],
                     startup_timeout_s=3)
    assert time.monotonic() - started < 3 + 15 + 5  # the timeout, the stop grace, slack
    message = str(failure.value)
    assert "not healthy" in message and "within 3 s" in message
    assert "fake server loading weights" in message  # the server's own log tail
    assert "--speculative" in message and "-m " in message  # our argv, as the server saw it
    leftovers = {child.pid for child in psutil.Process().children(recursive=True)} - before
    assert alive(leftovers) == []
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(fake) in " ".join(p.info["cmdline"] or [])]


def test_a_server_that_exits_reports_its_exit_code_and_log(tmp_path):
    server = ServerProcess([sys.executable, "-c", "import sys; print('bad flag --foo'); sys.exit(3)"],
                           name="crashy").start()
    with pytest.raises(EngineUnavailableError, match=r"(?s)crashy exited with code 3.*bad flag --foo"):
        server.wait_healthy("http://127.0.0.1:9/health", timeout_s=30, interval_s=0.05)


def test_stopping_counts_a_zombie_as_gone_and_a_live_process_as_left():
    from dflash_local.engines.launch import _wait_gone

    finished = subprocess.Popen([sys.executable, "-c", "pass"])  # exits; left unreaped: a zombie
    deadline = time.monotonic() + 30
    while psutil.Process(finished.pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    start = time.monotonic()
    assert _wait_gone([psutil.Process(finished.pid)], 10.0) == []
    assert time.monotonic() - start < 2.0  # not the whole timeout
    finished.wait()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert [p.pid for p in _wait_gone([psutil.Process(sleeper.pid)], 0.3)] == [sleeper.pid]
    finally:
        sleeper.kill()
        sleeper.wait()


def test_ctrl_c_in_the_parent_stops_the_server_group(tmp_path):
    """The parent is interrupted (SIGINT -> KeyboardInterrupt); atexit stops the server's group."""
    fake = tmp_path / "fake_server.py"
    fake.write_text(FAKE_SERVER)
    pids = tmp_path / "pids"
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""\
        import signal, sys, time
        # as in a terminal: a background job of a script inherits SIGINT ignored (a CI runner)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from dflash_local.engines.launch import ServerProcess
        server = ServerProcess([sys.executable, {str(fake)!r}]).start()
        time.sleep(1.0)
        open({str(pids)!r}, "w").write(str(server.pid))
        time.sleep(600)
    """)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not pids.exists() or not pids.read_text():
        assert time.monotonic() < deadline and parent.poll() is None, parent.stderr.read()
        time.sleep(0.05)
    family = [proc.pid for proc in family_of(int(pids.read_text()))]
    assert len(family) == 2  # the server and its own child
    parent.send_signal(signal.SIGINT)
    parent.wait(30)
    deadline = time.monotonic() + 20
    while alive(family) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert alive(family) == []


def test_serve_hands_the_server_python_and_args_to_the_launcher_only():
    import argparse

    from dflash_local.cli.options import serve_options
    from dflash_local.engines.options import EngineOptions
    from dflash_local.errors import InvalidRequestError
    from dflash_local.service import cli_serve

    parser = argparse.ArgumentParser()
    cli_serve.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--engine", "vllm", "--server-python", "/v/bin/python",
                              "--server-args", "--max-model-len 2048 --enforce-eager"])
    options = serve_options(args)
    assert options["vllm"] == EngineOptions(dtype="auto", plain_twin=False,
                                            server_python="/v/bin/python",
                                            extra_args=("--max-model-len", "2048", "--enforce-eager"))
    assert options["transformers"] == EngineOptions(dtype="auto", prefix_cache=True, prefix_cache_mb=None)
    args = parser.parse_args(["serve", "--engine", "mlx", "--server-args=--enforce-eager"])
    with pytest.raises(InvalidRequestError, match="go with --engine vllm or sglang, not --engine mlx"):
        cli_serve.run(args)


# --- the real vLLM (opt-in: minutes to start on a CPU) ---

def all_accept_pair(root: Path) -> tuple[Path, Path]:
    """A tiny target and drafter whose final norms are zero: both always predict token 0, so every
    draft is accepted and τ = B exactly."""
    from safetensors.torch import load_file, save_file
    from tiny_models import make_drafter, make_target

    target = make_target(root / "target", hidden=128, layers=4)
    drafter = make_drafter(root / "drafter", target, block_size=8)
    for path, key in ((target, "model.norm.weight"), (drafter, "norm.weight")):
        weights = load_file(path / "model.safetensors")
        weights[key].zero_()
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return target, drafter


@pytest.mark.vllm
@pytest.mark.skipif(not os.environ.get("DFLASH_VLLM_PYTHON"),
                    reason="set DFLASH_VLLM_PYTHON to an interpreter that has vllm or vllm-cpu")
def test_real_vllm_launch_counts_every_accepted_draft(tmp_path, monkeypatch):
    from dflash_local.events import GenerationParams

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; ignored by CUDA builds
    target, drafter = all_accept_pair(tmp_path)
    engine = VLLMEngine(target, drafter, target_name="tiny", dtype="float32",
                        server_python=os.environ["DFLASH_VLLM_PYTHON"], startup_timeout_s=1200,
                        extra_args=("--max-model-len", "512", "--enforce-eager"))
    family = [proc.pid for server in engine.servers for proc in family_of(server.pid)]
    try:
        messages = [{"role": "user", "content": "Count."}]
        events = list(engine.stream_chat(messages, GenerationParams(max_tokens=1 + 4 * 8)))
        stats = engine.last_stats
    finally:
        engine.close()
    assert [len(event.token_ids) for event in events] == [1, 8, 8, 8, 8]
    assert (stats.source, stats.rounds, stats.drafted, stats.accepted) == ("vllm-metrics", 4, 28, 28)
    assert stats.tau == 8.0 and stats.per_round_exact and stats.accepted_per_position == [4] * 7
    assert alive(family) == []


@pytest.mark.vllm
@pytest.mark.skipif(not os.environ.get("DFLASH_VLLM_PYTHON"),
                    reason="set DFLASH_VLLM_PYTHON to an interpreter that has vllm-cpu")
def test_real_vllm_serves_the_embedded_pair_as_our_engine_does(embedded_target_dir):
    """scripts/vllm_cpu_check.py: `serve --engine vllm` on the embedded target, greedy replies
    equal to the Transformers engine's, drafts counted by vLLM; DFlash 2 refused with vLLM's why."""
    script = Path(__file__).parents[1] / "scripts" / "vllm_cpu_check.py"
    env = {**os.environ, "DFLASH_EMBEDDED_TARGET": str(embedded_target_dir)}
    done = subprocess.run([sys.executable, str(script), "--server-python",
                           os.environ["DFLASH_VLLM_PYTHON"]], check=False, capture_output=True,
                          text=True, timeout=1800, env=env)
    summary = json.loads(done.stdout)
    assert [row["identical"] for row in summary["prompts"]] == [True] * 4, done.stdout
    assert all(row["vllm"]["drafted"] > 0 for row in summary["prompts"])
    if summary["server"] == "vllm-cpu 0.32.0":  # DFlash 2 needs vLLM's V2 runner, i.e. Triton
        assert summary["dflash2"] == {"runs": False, "exit": 2,
                                      "reason": "Model Runner V2 requires Triton."}
    assert done.returncode == 0


# --- --engine auto ---

LINUX_CUDA = ("Linux", "x86_64", True)


@pytest.mark.parametrize(("machine", "installed", "chosen"), [
    (LINUX_CUDA, {"vllm", "sglang", "torch"}, "vllm"),
    (LINUX_CUDA, {"sglang", "torch"}, "sglang"),
    (LINUX_CUDA, {"torch", "mlx"}, "transformers"),
    (("Linux", "x86_64", False), {"vllm", "torch", "mlx"}, "transformers"),
    (("Linux", "aarch64", False), {"mlx"}, "mlx"),
    (("Darwin", "arm64", False), {"mlx", "torch"}, "mlx"),
    (("Darwin", "arm64", False), {"torch"}, "transformers"),
])
def test_auto_picks_the_first_installed_engine_this_machine_prefers(machine, installed, chosen):
    assert choose_engine(PlatformInfo(*machine, installed=frozenset(installed))) == chosen


def test_auto_with_nothing_installed_says_what_to_install():
    info = PlatformInfo(*LINUX_CUDA, installed=frozenset())
    with pytest.raises(EngineUnavailableError, match=re.escape("dflash-local[vllm]")):
        choose_engine(info)
    assert preference(info)[:3] == ("vllm", "sglang", "transformers")
