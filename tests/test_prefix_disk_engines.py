"""The prefix cache's disk tier on real engines (method/prefix_disk.py): after a restart (a new
engine object on the same data dir) the next turn is served from disk, at least 90% of its
prompt cached, token for token what an engine without the cache gives (greedy, float32), on MLX
(a Qwen3 and a Qwen3.5 hybrid, its recurrent state kept whole) and Transformers (Qwen3, a
Qwen3.5 hybrid, Gemma 3 sliding windows kept whole); a flipped bit is detected and the entry
dropped; another pair is never served the entry; a restart's `preload_prefix_cache` (the
service's load runs it) reads the latest entries into RAM; bad budgets are refused before the
weights load."""

from __future__ import annotations

import json
import logging

import pytest
from fixtures_tiny import collect, params_of

from dflash_local.engines.local import prefix_cache_root
from dflash_local.events import GenerationStats

NEVER = -1  # random targets emit EOS early: never stop on it here
PROMPT = [(index * 37 + 11) % 250 + 1 for index in range(60)]
CASES = ["mlx-qwen3", "mlx-qwen3_5", "transformers-qwen3", "transformers-qwen3_5",
         "transformers-gemma3_text"]


def _mlx_pair(root, family: str, seed: int):
    pytest.importorskip("mlx.core")
    from mlx_tiny import write_target
    from tiny_models import make_drafter

    target = write_target(root / "target", family, seed=3)
    raw = json.loads((target / "config.json").read_text())
    flat = root / "flat_config"
    flat.mkdir(exist_ok=True)
    (flat / "config.json").write_text(json.dumps(raw.get("text_config") or raw))
    drafter = make_drafter(root / f"drafter{seed}", flat, seed=seed, layers=2, block_size=8,
                           taps=[1, 3, 4])
    return target, drafter


def _torch_pair(root, family: str, seed: int):
    pytest.importorskip("torch")
    from arch_tiny import drafter_for, hf_target

    target = hf_target(root / "target", family, seed=3)
    return target, drafter_for(root / f"drafter{seed}", target, seed=seed)


@pytest.fixture(params=CASES)
def make_engine(request, tmp_path, monkeypatch):
    """make(disk_mb, cache=True, drafter_seed=1): a new engine on the case's pair, its data dir
    this test's own (a restart: another call)."""
    monkeypatch.setenv("DFLASH_LOCAL_HOME", str(tmp_path / "home"))
    engine_name, family = request.param.split("-")
    pairs = {}

    def make(disk_mb: int | None = 64, cache: bool = True, drafter_seed: int = 1):
        if drafter_seed not in pairs:
            build = _mlx_pair if engine_name == "mlx" else _torch_pair
            pairs[drafter_seed] = build(tmp_path, family, drafter_seed)
        if engine_name == "mlx":
            from dflash_local.engines.mlx_engine import MLXEngine as Engine
        else:
            from dflash_local.engines.torch_engine import TorchEngine as Engine
        return Engine(*pairs[drafter_seed], dtype="float32", prefix_cache=cache,
                      prefix_cache_mb=64, prefix_cache_disk_mb=disk_mb)

    return make


def turn(engine, prompt_ids, max_tokens=10):
    params = params_of(max_tokens=max_tokens, block_size=4, stop_token_ids=(NEVER,))
    tokens, events = collect(engine.stream(prompt_ids, params))
    stats = GenerationStats()
    for event in events:
        stats.add(event)
    return tokens, stats


def first_turn(make):
    """The first turn's reply, on an engine whose entries are then on disk."""
    engine = make()
    reply, stats = turn(engine, PROMPT)
    assert stats.cached_tokens == 0
    engine.prefix_disk.flush()
    return PROMPT + reply + [7, 8, 9]


def test_a_restart_serves_the_next_turn_from_disk_and_equals_no_cache(make_engine):
    second = first_turn(make_engine)
    restarted = make_engine()
    assert len(restarted.prefix_cache) == 0  # nothing in RAM: what follows comes from disk
    tokens, stats = turn(restarted, second)
    assert stats.cached_tier == "disk"
    assert stats.cached_tokens >= 0.9 * len(second)
    plain, plain_stats = turn(make_engine(cache=False), second)
    assert tokens == plain and plain_stats.cached_tokens == 0
    again, stats = turn(restarted, second)  # now the RAM tier holds it
    assert again == plain and stats.cached_tier == "ram"


def test_a_flipped_bit_is_detected_and_the_entry_dropped(make_engine, caplog):
    second = first_turn(make_engine)
    payloads = sorted(prefix_cache_root().glob("*/*.safetensors"))
    assert payloads
    for payload in payloads:
        data = bytearray(payload.read_bytes())
        data[len(data) // 2] ^= 0x10
        payload.write_bytes(bytes(data))
    restarted = make_engine()
    with caplog.at_level(logging.WARNING, logger="dflash_local.method.prefix_disk"):
        tokens, stats = turn(restarted, second)
    assert stats.cached_tokens == 0
    assert "sha256" in caplog.text
    assert any(not payload.exists() for payload in payloads)  # the one tried is deleted
    assert tokens == turn(make_engine(cache=False), second)[0]


def test_another_pair_is_never_served_the_entry(make_engine):
    second = first_turn(make_engine)
    other = make_engine(drafter_seed=2)  # the same target, another drafter
    assert other.prefix_disk.entries() == {}
    _, stats = turn(other, second)
    assert stats.cached_tokens == 0
    assert len({path.parent for path in prefix_cache_root().glob("*/pair.json")}) == 2


def test_a_budget_of_0_turns_the_disk_tier_off(make_engine):
    engine = make_engine(disk_mb=0)
    assert engine.prefix_disk is None and engine.prefix_cache is not None
    assert engine.prefix_cache_status()["disk"] is None


def test_a_next_turn_warmed_while_idle_is_written_too(make_engine):
    import threading

    from dflash_local.engines import turn_warmup

    engine = make_engine()
    reply, _ = turn(engine, PROMPT)
    history = PROMPT + reply + [7, 8]
    params = params_of(max_tokens=10, block_size=4, stop_token_ids=(NEVER,))
    assert turn_warmup.warm(engine, history, params, lambda: False, threading.Lock())
    engine.prefix_disk.flush()
    held = [entry.token_ids.tolist() for entry in make_engine().prefix_disk.entries().values()]
    assert history in held


def test_a_data_dir_that_cannot_be_written_leaves_ram_only(make_engine, tmp_path, monkeypatch,
                                                          caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("DFLASH_LOCAL_HOME", str(blocked / "home"))
    with caplog.at_level(logging.WARNING, logger="dflash_local.method.prefix_disk"):
        engine = make_engine()
    assert engine.prefix_disk is None and "RAM only" in caplog.text
    assert turn(engine, PROMPT)[0] == turn(make_engine(cache=False), PROMPT)[0]


def test_a_restart_reads_the_latest_entries_into_ram_at_load(make_engine):
    second = first_turn(make_engine)
    restarted = make_engine()
    assert restarted.preload_prefix_cache() > 0  # what the service's load runs
    assert len(restarted.prefix_cache) == len(restarted.prefix_disk.entries()) > 0  # a hybrid: 2
    tokens, stats = turn(restarted, second)
    assert stats.cached_tier == "ram" and stats.cached_tokens >= 0.9 * len(second)
    assert tokens == turn(make_engine(cache=False), second)[0]


def test_bad_budgets_are_refused_before_the_weights_load(make_engine, monkeypatch):
    from dflash_local.errors import InvalidRequestError

    engine_class = type(make_engine())

    def no_weights(*args):
        raise AssertionError("the weights loaded before the budgets were checked")

    monkeypatch.setattr(engine_class, "load_target", no_weights)
    with pytest.raises(InvalidRequestError, match="--prefix-cache-disk-mb must be >= 0, got -1"):
        make_engine(disk_mb=-1)
    with pytest.raises(InvalidRequestError, match="is more than the free space of"):
        make_engine(disk_mb=1 << 40)
