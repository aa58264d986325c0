"""The prefix cache's disk tier through the service: after the service restarts on the same
data dir, the load reads the latest entries into RAM, and with RAM emptied a conversation's
next turn comes from disk (`cached_tokens` at least 90% of the prompt, `dflash.cached_tier`
"disk") and answers what a `--no-prefix-cache` server answers; /dflash/status shows the tier;
`dflash-local cache list|clear`; the disk flags refused with their reasons before anything
loads; switching pairs leaves one disk writer, not one per load."""

from __future__ import annotations

import threading

import httpx
import pytest
from service_support import make_pair, wait_until
from test_service_prefix_cache import _start, ask

from dflash_local.cli.main import main

TALK = [{"role": "system", "content": "You are a patient guide to rivers and lakes. " * 12},
        {"role": "user", "content": "Tell me about the longest rivers of Europe."}]


def _stop(server) -> None:
    server.stop()


def test_a_restarted_service_serves_the_next_turn_from_disk(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DFLASH_LOCAL_HOME", str(tmp_path / "home"))
    pair = make_pair(tmp_path / "pair")
    state, server, client = _start(pair, "--prefix-cache-disk-mb", "64")
    first, usage = ask(client, TALK, stream=True)
    status = httpx.get(server.url + "/dflash/status").json()["prefix_cache"]
    assert status["disk"]["budget_bytes"] == 64 << 20
    state.loaded.engine.prefix_disk.flush()
    _stop(server)

    talk = [*TALK, {"role": "assistant", "content": first}, {"role": "user", "content": "And?"}]
    state, server, client = _start(pair, "--prefix-cache-disk-mb", "64")  # the restart
    assert len(state.loaded.engine.prefix_cache) > 0  # the load read the latest entries into RAM
    state.loaded.engine.prefix_cache.clear()  # what follows can only come from disk
    second, usage = ask(client, talk, stream=False)
    assert usage.model_extra["dflash"]["cached_tier"] == "disk"
    assert usage.prompt_tokens_details.cached_tokens >= 0.9 * usage.prompt_tokens
    state.loaded.engine.prefix_disk.flush()
    _stop(server)
    _, plain_server, plain_client = _start(pair, "--no-prefix-cache")
    plain, plain_usage = ask(plain_client, talk, stream=False)
    _stop(plain_server)
    assert second == plain and plain_usage.prompt_tokens_details.cached_tokens == 0

    capsys.readouterr()
    assert main(["cache", "list"]) == 0
    listed = capsys.readouterr().out
    assert "transformers float32" in listed and f"{usage.prompt_tokens + usage.completion_tokens - 1:>7} tokens" in listed
    assert main(["cache", "clear"]) == 0
    assert "entries deleted" in capsys.readouterr().out
    assert main(["cache", "list"]) == 0
    assert ": 0 entries" in capsys.readouterr().out


@pytest.mark.parametrize(("flags", "message"), [
    (["--prefix-cache-disk-mb", "-1"], "--prefix-cache-disk-mb must be >= 0"),
    (["--prefix-cache-disk-mb", str(1 << 40)], "is more than the free space of"),
    (["--prefix-cache-disk-mb", "64", "--no-prefix-cache"], "not both"),
])
def test_bad_disk_budgets_are_refused_before_anything_loads(flags, message, capsys):
    assert main(["serve", "--no-load", *flags]) != 0
    assert message in capsys.readouterr().err


def test_switching_pairs_leaves_one_disk_writer(tmp_path, monkeypatch):
    from dflash_local.cli.main import build_parser
    from dflash_local.cli.options import serve_options
    from dflash_local.events import parse_block_size
    from dflash_local.service.state import ServiceState

    monkeypatch.setenv("DFLASH_LOCAL_HOME", str(tmp_path / "home"))
    pairs = [make_pair(tmp_path / f"pair{seed}", seed=seed) for seed in (0, 1)]
    args = build_parser().parse_args(["serve", "--engine", "transformers", "--dtype", "float32",
                                      "--prefix-cache-disk-mb", "64"])
    state = ServiceState(load_options=serve_options(args))

    def writers() -> int:
        return sum(thread.name == "prefix-disk" for thread in threading.enumerate())

    before = writers()
    for switch in range(4):
        state.load("transformers", *pairs[switch % 2], served_name="tiny",
                   block_size=parse_block_size(4))
    wait_until(lambda: writers() == before + 1)  # a replaced pair is closed once its worker drains
    state.unload()
    assert writers() == before


def test_a_disk_tier_that_fails_to_preload_costs_the_speed_up_not_the_load(tmp_path, monkeypatch,
                                                                          caplog):
    from service_support import torch_loader

    from dflash_local.service.state import ServiceState

    monkeypatch.setenv("DFLASH_LOCAL_HOME", str(tmp_path / "home"))
    pair = make_pair(tmp_path / "pair")

    def unreadable_disk_tier(*args):
        engine = torch_loader(*args)

        def preload():
            raise OSError("Input/output error")
        engine.preload_prefix_cache = preload
        return engine

    state = ServiceState(loader=unreadable_disk_tier)
    try:
        state.load("transformers", *pair, served_name="tiny")
        assert state.loaded is not None and state.load_error is None
        assert "serving without" in caplog.text and "Input/output error" in caplog.text
    finally:
        state.shutdown()
