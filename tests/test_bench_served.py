"""`dflash-local bench --engine openai --base-url URL`: the same datasets over HTTP, against our
own service (`dflash-local serve` in a child process on 127.0.0.1, the embedded pair), with
acceptance from the server's own per-round `dflash` statistics."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from dflash_local.cli.main import main


@pytest.fixture(scope="module")
def embedded_service(embedded_target_dir, tmp_path_factory):
    """`dflash-local serve` of the embedded pair (block size 4: no calibration), its URL."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}  # the session's data dir: the import
    command = [sys.executable, "-m", "dflash_local.cli.main", "serve", "--port", "0", "--engine",
               "transformers", "--block-size", "4"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env)
    try:
        line = process.stdout.readline()
        url = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
        assert url, (line, process.stderr.read() if process.poll() is not None else "")
        yield url[1]
    finally:
        process.terminate()
        assert process.wait(60) in (0, -signal.SIGTERM)


def test_bench_measures_our_own_service_over_http(embedded_service, tmp_path, capsys):
    out = tmp_path / "results"
    assert main(["bench", "--engine", "openai", "--base-url", embedded_service + "/v1",
                 "--dataset", "chat", "--max-samples", "2", "--max-tokens", "24",
                 "--block-size", "4", "--out", str(out)]) == 0
    record = json.loads(next(out.glob("*.json")).read_text())
    assert record["engine"] == "openai" and record["dtype"] == "server"
    assert record["calibration"] is None  # the server plans its own rounds
    result = record["datasets"]["chat"]
    assert list(result["methods"]) == ["plain", "dflash B=4"]
    speculative = result["methods"]["dflash B=4"]
    assert speculative["acceptance_source"] == "dflash"  # the service's per-round stats
    assert 1.0 <= speculative["tau"] <= 4 and sum(speculative["acceptance_histogram"]) > 0
    assert "tau" not in result["methods"]["plain"]
    for sample in result["samples"]:
        plain = sample["methods"]["plain"]
        assert 0 < plain["completion_tokens"] <= 24 and plain["prompt_tokens"] > 0
        assert sample["identical_to_plain"] == {"dflash B=4": True}  # greedy, token for token
        assert set(sample["methods"]["dflash B=4"]["widths"]) <= {1, 2, 3, 4}
    table = capsys.readouterr().out
    assert "dflash B=4" in table and "identical 2/2" in table


def test_served_bench_options_are_checked_before_anything_loads(capsys):
    assert main(["bench", "--engine", "openai"]) == 2
    assert "--engine openai needs --base-url URL, the server to measure (got none)" in capsys.readouterr().err
    assert main(["bench", "--engine", "openai", "--base-url", ""]) == 2
    assert "needs --base-url URL, the server to measure (got an empty one)" in capsys.readouterr().err
    assert main(["bench", "--engine", "mlx", "--base-url", "http://127.0.0.1:9"]) == 2
    assert ("--base-url 'http://127.0.0.1:9' goes with --engine openai only; --engine mlx runs "
            "the pair here") in capsys.readouterr().err
    assert main(["bench", "--engine", "vllm", "--base-url", "http://127.0.0.1:9"]) == 2
    assert "--engine vllm starts its own server" in capsys.readouterr().err
    assert main(["bench", "--engine", "transformers", "--api-key", "k"]) == 2
    assert "--api-key go with --engine openai only (got --engine transformers)" in capsys.readouterr().err
    assert main(["bench", "--engine", "openai", "--base-url", "http://127.0.0.1:9",
                 "--lookup", "both"]) == 2
    assert "--lookup and --tree are the server's own settings" in capsys.readouterr().err
    assert main(["bench", "--engine", "openai", "--base-url", "http://127.0.0.1:9"]) == 2
    assert "cannot reach http://127.0.0.1:9" in capsys.readouterr().err
