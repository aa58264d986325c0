"""The Mac peers' processes (bench/peer_process.py driving bench/peer_driver.py): the protocol in
a real subprocess, the rows a peer that cannot run leaves in the table, and, opt-in, the real
dflash-mlx and mlx-dspark on the embedded pair.

The real-peer test is opt-in (DFLASH_TEST_PEER_PYTHON=<a peer environment's python>, made by
scripts/setup_peers.sh): mlx-dspark calibrates for about 11 minutes (21 on a busy machine) on
its first use of a pair, cached in the data dir, which is the test session's own and temporary.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
from fixtures_tiny import tiny_engine, tiny_pair

from dflash_local.bench import peer_backends, peer_process
from dflash_local.bench.peers import process_peers
from dflash_local.cli.main import main
from dflash_local.events import GenerationParams


def test_the_driver_speaks_json_in_its_own_process_and_loads_our_blas_first(home):
    # our own venv's Python stands in for a peer environment: it has mlx, not the peers
    process = peer_process.PeerProcess(sys.executable, log=lambda line: None)
    try:
        with pytest.raises(peer_process.PeerProcessError, match="'load' before hello: the BLAS"):
            process.request("load", peer="dflash-mlx")
        binding = peer_process.blas_binding(threads=1)
        hello = process.request("hello", blas=binding)
        assert hello["python"] == sys.executable
        assert hello["packages"]["dflash-mlx"] is None and hello["packages"]["mlx"]
        if binding["library"]:  # Linux with an OpenBLAS: the process computes on ours
            assert hello["blas"] == {**hello["blas"], "library": binding["library"], "threads": 1}
            assert hello["blas"]["gflops"] > 0
        with pytest.raises(peer_process.PeerProcessError, match="unknown op 'fly'"):
            process.request("fly")
        with pytest.raises(peer_process.PeerProcessError, match="unknown peer 'vllm-mlx'"):
            process.request("load", peer="vllm-mlx")
        with pytest.raises(peer_process.PeerProcessError,
                           match=r"dflash-mlx is not installed for .*scripts/setup_peers.sh"):
            process.request("load", peer="dflash-mlx", target="t", drafter="d",
                            drafter_dtype="default", cache_dir=str(home))
        with pytest.raises(peer_process.PeerProcessError, match="generate before load"):
            process.request("generate", prompt_ids=[1], max_tokens=4)
    finally:
        process.close()
    assert process.process.returncode == 0  # EOF ended it


def test_a_binding_for_another_mlx_is_refused(home):
    process = peer_process.PeerProcess(sys.executable, log=lambda line: None)
    try:
        with pytest.raises(peer_process.PeerProcessError,
                           match="bundles BLAS .* the bench's 'libblas-other.so': the OpenBLAS"):
            process.request("hello", blas={"library": "/x/lib.so", "bundled": "libblas-other.so",
                                           "threads": 1})
    finally:
        process.close()


def test_peers_that_cannot_start_stay_in_the_table_with_the_reason(tmp_path_factory, home):
    engine = tiny_engine(tiny_pair(tmp_path_factory, "qwen3"))
    lines: list[str] = []
    missing = process_peers(engine, str(home / "no-venv" / "python"), ("mlx-dspark",), lines.append)
    assert [peer.name for peer in missing] == ["mlx-dspark, its defaults",
                                              "mlx-dspark, drafter float32"]
    assert all(peer.run is None and "does not exist (--peer-python / DFLASH_PEER_PYTHON"
               in peer.unavailable for peer in missing)
    # a Python without the peer: a real process starts, greets, and its load says why
    without = process_peers(engine, sys.executable, ("dflash-mlx",), lines.append)
    assert all(peer.run is None and "dflash-mlx is not installed for" in peer.unavailable
               for peer in without)
    assert [line for line in lines if line.startswith("starting")] == [
        "starting peer mlx-dspark (its defaults)...", "starting peer mlx-dspark (drafter float32)...",
        "starting peer dflash-mlx (its defaults)...", "starting peer dflash-mlx (drafter float32)..."]
    assert sum(line.startswith("peer dflash-mlx cannot run: dflash-mlx is not installed")
               for line in lines) == 2
    nothing_set = process_peers(engine, None, ("dflash-mlx",), lines.append)
    assert "scripts/setup_peers.sh" in nothing_set[0].unavailable
    sampling = process_peers(engine, sys.executable, ("dflash-mlx",), lines.append, greedy=False)
    assert "greedy only (--temperature 0)" in sampling[1].unavailable
    assert len(lines) == 8  # no process started for those two


def test_the_setting_is_the_flag_then_the_environment_never_a_guess(monkeypatch):
    monkeypatch.delenv(peer_process.PEER_PYTHON_ENV, raising=False)
    assert peer_process.peer_python_setting(None) is None
    monkeypatch.setenv(peer_process.PEER_PYTHON_ENV, "/env/python")
    assert peer_process.peer_python_setting(None) == "/env/python"
    assert peer_process.peer_python_setting("/flag/python") == "/flag/python"


def test_a_peer_is_measured_greedy_only():
    with pytest.raises(peer_process.PeerProcessError, match="greedy only"):
        peer_process.generate(None, [1], GenerationParams(temperature=0.7))


class _ScriptedPeer:
    """A peer process that answers generate with one reply (the driver's own reply_figures)."""

    def __init__(self, reply: dict, name: str = ""):
        self.reply, self.lines, self.name = reply, [], name

    def request(self, op: str, **fields) -> dict:
        return {"ok": True, **self.reply}

    def log(self, line: str) -> None:
        self.lines.append(line)


def test_tokens_a_peer_commits_past_max_tokens_are_cut_off_with_their_rounds():
    # mlx-dspark 0.20.3 on embedded/0 (64 tokens): its last round commits 3 from 63 tokens -> 66
    request = {"prompt_ids": [1, 2, 3], "max_tokens": 64}
    reply = peer_backends.reply_figures(request, list(range(66)), 0.0, 0.5, 2.5, [2] * 31 + [3])
    assert reply["token_ids"] == list(range(64)) and reply["tokens_past_max"] == 2
    assert reply["committed_per_round"] == [2] * 31 + [1]  # 63 after the prefill's token
    process = _ScriptedPeer(reply, peer_process.row_name("mlx-dspark", "0.20.3", "float32"))
    figures = peer_process.generate(process, request["prompt_ids"], GenerationParams(max_tokens=64))
    assert figures.token_ids == list(range(64)) and figures.completion_tokens == 64
    assert figures.tau == 63 / 32
    cut = "mlx-dspark 0.20.3, drafter float32 returned 2 tokens past max_tokens 64: cut off"
    assert process.lines == [cut]  # it names the row whose figures were cut
    within = peer_backends.reply_figures(request, list(range(40)), 0.0, 0.5, 2.5, [3] * 13)
    assert within["token_ids"] == list(range(40)) and within["tokens_past_max"] == 0
    assert within["committed_per_round"] == [3] * 13
    assert peer_process.generate(_ScriptedPeer(within), [1], GenerationParams()).token_ids == \
        list(range(40))


PEER_PYTHON = os.environ.get("DFLASH_TEST_PEER_PYTHON")


@pytest.mark.skipif(not PEER_PYTHON, reason="opt-in: DFLASH_TEST_PEER_PYTHON=<peer env python> "
                                            "(mlx-dspark calibrates 11-21 min on first use)")
def test_the_real_mac_peers_on_the_embedded_pair(embedded_target_dir, tmp_path):
    """The shipped pair, in the session's data dir (where the fixture imported its target):
    1 chat prompt x 8 tokens. DFLASH_TEST_MAC_PEERS=dflash-mlx runs one peer."""
    out = tmp_path / "results"
    peers = os.environ.get("DFLASH_TEST_MAC_PEERS", "dflash-mlx,mlx-dspark")
    assert main(["bench", "--engine", "mlx", "--dataset", "chat", "--max-samples", "1",
                 "--max-tokens", "8", "--peers", "--peer-python", PEER_PYTHON,
                 "--mac-peers", peers, "--out", str(out)]) == 0
    record = json.loads(next(out.glob("*.json")).read_text())
    result = record["datasets"]["chat"]
    rows = [peer_process.row_name(name, version, dtype) for name in peers.split(",")
            for version in (None, {"dflash-mlx": "0.1.8", "mlx-dspark": "0.20.3"}[name])
            for dtype in peer_process.DRAFTER_DTYPES]
    measured = [row for row in rows if row in result["methods"]]
    refused = [row for row in rows if row in result["unavailable"]]
    assert len(measured) + len(refused) == 2 * len(peers.split(","))
    for row in measured:
        assert 0 < result["methods"][row]["completion_tokens"] <= 8
        assert record["peers"][row]["blas"]["threads"] == record["threads"]
    for row in refused:
        assert result["unavailable"][row].startswith("n/a: ")
    if "mlx-dspark" in peers:  # it loads DFlash 2 drafters: measured, and lossless at greedy
        for dtype in peer_process.DRAFTER_DTYPES:
            row = peer_process.row_name("mlx-dspark", "0.20.3", dtype)
            assert result["samples"][0]["identical_to_plain"][row] is True
