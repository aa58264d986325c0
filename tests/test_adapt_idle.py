"""Adaptation while idle on real pairs (adapt/idle.py, adapt/trainer.py): the embedded pair
(DFlash 2 with its selector, a draft vocabulary, replay of its shipped data) keeps a worse
candidate out, writes and swaps in a better one, restarts on the last good version, and decodes
with an adapted drafter exactly as plain; the worker lets a request in after one slice; the tiny
pair (a v1 drafter, pulled toward its weights) serves the status contract."""

from __future__ import annotations

import threading
from contextlib import closing

import httpx
import pytest
import torch
from service_support import make_pair, start_service, wait_until

from dflash_local.adapt import idle
from dflash_local.adapt.idle import RoundSettings, build_adaptation
from dflash_local.adapt.record import ReplyRecorder, recorded_pair
from dflash_local.adapt.store import ReplyStore
from dflash_local.adapt.trainer import AdaptSettings
from dflash_local.drafter.model_torch import load_drafter
from dflash_local.engines.drafter_swap import swap_drafter
from dflash_local.errors import DFlashError
from dflash_local.events import Fixed, GenerationParams

PROMPTS = ["Write a Python function that adds two numbers.", "Write a Python function that reverses a string.",
           "Write a Python function that returns the largest item of a list.",
           "Write a Python function that counts the vowels in a string.",
           "Write a Python function that squares every number in a list."]
# a round after every 3 replies, the 2 newest judging, one step per reply: seconds, not minutes
QUICK = RoundSettings(min_new_replies=3, held_out=2, steps_per_new_reply=1, score_anchors=8,
                      replay_per_round=1, replay_pool=2)


def tokens(engine, prompt_ids, block_size: int) -> list[int]:
    params = GenerationParams(max_tokens=32, block_size=Fixed(block_size), prompt_lookup=False)
    return [token for event in engine.stream(prompt_ids, params) for token in event.token_ids]


@pytest.fixture(scope="module")
def embedded(embedded_target_dir):
    """The embedded pair's engine and its greedy replies to PROMPTS (prompt ids, reply ids)."""
    from dflash_local import paths
    from dflash_local.engines.torch_engine import TorchEngine
    from dflash_local.pairs.default_pair import EMBEDDED_DRAFTER_DIR

    engine = TorchEngine(embedded_target_dir, paths.shipped_models_dir() / EMBEDDED_DRAFTER_DIR)
    replies = []
    for prompt in PROMPTS:
        prompt_ids = engine.encode_chat([{"role": "user", "content": prompt}])
        replies.append((prompt_ids, tokens(engine, prompt_ids, 16)))
    yield engine, replies
    engine.close()


def recording(engine, replies, home, monkeypatch) -> ReplyRecorder:
    """A fresh data dir holding `replies` as the pair's recorded ones."""
    monkeypatch.setenv("DFLASH_LOCAL_HOME", str(home))
    recorder = ReplyRecorder(recorded_pair(engine.pair, ("target", "drafter")))
    with closing(ReplyStore()) as store:
        for prompt_ids, reply_ids in replies:
            store.add(recorder.pair, prompt_ids, reply_ids, {})
    return recorder


def run_until_idle(adaptation) -> int:
    slices = 0
    while adaptation.has_work():
        adaptation.run_slice()
        slices += 1
    return slices


def noised(state: dict, scale: float) -> dict:
    generator = torch.Generator().manual_seed(0)
    return {name: tensor + scale * tensor.std() * torch.randn(tensor.shape, generator=generator)
            for name, tensor in state.items()}


@pytest.mark.slow
def test_a_worse_candidate_is_kept_out(embedded, tmp_path, monkeypatch):
    engine, replies = embedded
    adaptation = build_adaptation(engine, recording(engine, replies, tmp_path, monkeypatch), QUICK)
    trainer = adaptation.trainer
    trainer.candidate.load_state_dict(noised(trainer.shipped, 1.0))
    assert run_until_idle(adaptation) > 0
    assert adaptation.versions.numbers() == [] and engine.drafter_version is None
    status = adaptation.status()
    assert status["tau_recent"]["serving"] > 1.5  # the shipped drafter, judged on its own target's replies
    assert status["last_round"]["verdict"] == idle.RESTART
    assert (status["replies"], status["pending"], status["trained_on"]) == (5, 0, 5)
    candidate = trainer.candidate.state_dict()
    assert all(torch.equal(candidate[name].cpu(), trainer.shipped[name]) for name in trainer.shipped)
    adaptation.close()


@pytest.mark.slow
def test_a_candidate_within_the_noise_trains_on_from_where_it_is(embedded, tmp_path, monkeypatch):
    engine, replies = embedded
    adaptation = build_adaptation(engine, recording(engine, replies, tmp_path, monkeypatch), QUICK,
                                  AdaptSettings(lr=0.0))
    trainer = adaptation.trainer
    nudged = noised(trainer.shipped, 1e-4)  # drafts as the shipped one does, weights not its own
    trainer.candidate.load_state_dict(nudged)
    run_until_idle(adaptation)
    assert adaptation.status()["last_round"]["verdict"] == idle.TRAIN_ON
    assert adaptation.versions.numbers() == [] and engine.drafter_version is None
    candidate = trainer.candidate.state_dict()
    assert all(torch.equal(candidate[name].cpu(), nudged[name]) for name in nudged)  # not restarted
    adaptation.close()


@pytest.mark.slow
def test_a_better_candidate_serves_losslessly_and_a_restart_takes_the_last_good(embedded, tmp_path,
                                                                                monkeypatch):
    engine, replies = embedded
    recorder = recording(engine, replies, tmp_path, monkeypatch)
    adaptation = build_adaptation(engine, recorder, QUICK, AdaptSettings(lr=0.0))
    trainer = adaptation.trainer
    trainer.candidate.load_state_dict(noised(trainer.shipped, 0.5))  # v1: a worse drafter, serving
    adaptation.versions.publish(trainer.save_candidate, {"trained_on": 0, "tau_before": 0.0,
                                                         "tau_after": 0.0, "at": "then"})
    adaptation.close()
    adaptation = build_adaptation(engine, recorder, QUICK, AdaptSettings(lr=0.0))
    assert engine.drafter_version == 1
    prompt_ids = replies[0][0]
    assert tokens(engine, prompt_ids, 16) == tokens(engine, prompt_ids, 1) == replies[0][1]
    adaptation.trainer.candidate.load_state_dict(adaptation.trainer.shipped)  # the better one
    run_until_idle(adaptation)
    assert engine.drafter_version == 2 and adaptation.versions.pointed() == 2
    latest = adaptation.status()["history"][-1]
    assert latest["version"] == 2 and latest["tau_after"] > latest["tau_before"]
    assert tokens(engine, prompt_ids, 16) == replies[0][1]
    assert load_drafter(adaptation.versions.path_of(2)).config == engine.drafter.config  # z-lab's format
    adaptation.close()
    weights = adaptation.versions.path_of(2) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])  # a torn write
    restarted = build_adaptation(engine, recorder, QUICK)
    assert engine.drafter_version == 1  # the last good version
    with pytest.raises(DFlashError):  # another target's drafter: refused, v1 still drafts
        swap_drafter(engine, make_pair(tmp_path / "tiny")[1], 9)
    assert engine.drafter_version == 1
    restarted.versions.reset()
    run_until_idle(restarted)  # follows the reset back to the shipped drafter
    assert engine.drafter_version is None
    restarted.close()


def test_a_swap_takes_weights_held_in_memory_and_the_target_as_loaded(tmp_path, monkeypatch):
    from dflash_local.drafter import model_torch
    from dflash_local.engines.torch_engine import TorchEngine

    target, drafter = make_pair(tmp_path)
    engine = TorchEngine(target, drafter)
    state = noised(load_drafter(drafter).state_dict(), 0.1)
    (target / "config.json").unlink()  # the target as the engine read it at load is checked
    monkeypatch.setattr(model_torch, "load_file", lambda path: pytest.fail(f"{path} read again"))
    swap_drafter(engine, drafter, 1, {name: tensor.numpy() for name, tensor in state.items()})
    assert engine.drafter_version == 1
    assert torch.equal(engine.drafter.norm.weight.float(), state["norm.weight"])
    engine.close()


class ScriptedWork:
    """Idle work whose first slice is held open until the test has submitted a job."""

    def __init__(self, worker_jobs_done):
        self.jobs_done = worker_jobs_done
        self.held = threading.Event()
        self.running = threading.Event()
        self.slices: list[int] = []  # jobs done when each slice started

    def has_work(self) -> bool:
        return len(self.slices) < 3

    def run_slice(self) -> None:
        self.slices.append(self.jobs_done())
        self.running.set()
        if len(self.slices) == 1:
            self.held.wait(30)


def test_a_request_arriving_during_a_slice_runs_before_the_next_slice(tmp_path):
    import asyncio

    from dflash_local.engines.torch_engine import TorchEngine
    from dflash_local.service.job_items import JobRequest
    from dflash_local.service.worker import GenerationWorker, Job

    engine = TorchEngine(*make_pair(tmp_path))
    worker = GenerationWorker(engine)
    work = ScriptedWork(lambda: worker.jobs_done)
    worker.idle_work = work
    def request(text: str) -> Job:  # its loop never runs: the test reads the worker's counts
        return Job(JobRequest([{"role": "user", "content": text}], GenerationParams(max_tokens=4),
                              max_tokens_given=True), asyncio.new_event_loop())

    worker.submit(request("hi"))  # wakes the worker: after it, the slices
    assert work.running.wait(30)
    worker.submit(request("hello"))
    work.held.set()
    wait_until(lambda: len(work.slices) == 3)
    assert work.slices == [1, 2, 2]  # the job that came during slice 1 ran before slice 2
    worker.close()
    engine.close()


class LateWork:
    """Idle work that appears with no job to wake the worker (`adapt reset` from the CLI)."""

    def __init__(self):
        self.appeared = False
        self.ran = threading.Event()

    def has_work(self) -> bool:
        return self.appeared and not self.ran.is_set()

    def run_slice(self) -> None:
        self.ran.set()


def test_idle_work_that_appears_without_a_job_runs(tmp_path, monkeypatch):
    from dflash_local.engines.torch_engine import TorchEngine
    from dflash_local.service import worker as worker_module

    monkeypatch.setattr(worker_module, "IDLE_POLL_S", 0.05)
    engine = TorchEngine(*make_pair(tmp_path))
    work = LateWork()
    worker = worker_module.GenerationWorker(engine, idle_work=work)
    wait_until(lambda: not worker.busy)
    work.appeared = True  # no submit follows: only the idle poll can find it
    assert work.ran.wait(30)
    worker.close()
    engine.close()


CONTRACT = {"enabled", "recording", "replies", "pending", "training", "version", "trained_on",
            "tau_recent", "last_round", "history"}


def caught_up(server) -> dict | None:
    """/dflash/status's adapt once the four replies are trained on and no round runs."""
    adapt = httpx.get(server.url + "/dflash/status").json()["adapt"]
    return adapt if adapt["replies"] == 4 and adapt["pending"] == 0 and not adapt["training"] else None


def test_the_service_reports_the_status_contract(tmp_path, monkeypatch, capsys):
    import json

    from dflash_local.cli.main import main

    monkeypatch.setenv("DFLASH_LOCAL_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(idle, "TRAIN_WHILE_IDLE", True)
    state, server = start_service(*make_pair(tmp_path / "pair"))
    try:
        for word in ("one", "two", "three", "four"):
            answer = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
                "model": "tiny", "messages": [{"role": "user", "content": word}], "max_tokens": 12})
            assert answer.json()["usage"]["dflash"]["drafter_version"] is None
        adapt = wait_until(lambda: caught_up(server), timeout=300)
    finally:
        server.stop()
        state.unload()
    assert CONTRACT <= set(adapt) and adapt["enabled"] and adapt["recording"]
    assert adapt["trained_on"] == 4 and isinstance(adapt["tau_recent"]["serving"], float)
    assert adapt["last_round"]["verdict"] in (idle.PUBLISH, idle.RESTART, idle.TRAIN_ON)
    assert adapt["last_round"]["held_out_blocks"] > 0
    assert main(["adapt", "status", "--json"]) == 0
    offline = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["adapt"]
    assert CONTRACT <= set(offline)
    assert {key: offline[key] for key in ("replies", "pending", "version", "trained_on", "history")} == {
        key: adapt[key] for key in ("replies", "pending", "version", "trained_on", "history")}


def test_the_mlx_engine_adapts_through_a_torch_teacher_and_serves_the_version_losslessly(
        tmp_path, monkeypatch):
    """Torch trains beside the MLX engine (its own torch copy of the target); the version it
    writes is z-lab's format, which the MLX engine loads and decodes with as plainly."""
    pytest.importorskip("mlx.core")
    from dflash_local.engines import engine_class_for

    engine = engine_class_for("mlx")(*make_pair(tmp_path / "pair"))
    replies = []
    for word in ("one", "two", "three", "four"):
        prompt_ids = engine.encode_chat([{"role": "user", "content": word}])
        replies.append((prompt_ids, tokens(engine, prompt_ids, 8)))
    adaptation = build_adaptation(engine, recording(engine, replies, tmp_path / "home", monkeypatch),
                                  QUICK)
    assert run_until_idle(adaptation) > 0 and adaptation.status()["pending"] == 0
    version = adaptation.versions.publish(adaptation.trainer.save_candidate, {
        "trained_on": 4, "tau_before": 1.0, "tau_after": 1.0, "at": "now"})
    swap_drafter(engine, version.path, version.number)
    assert engine.drafter_version == 1
    prompt_ids = replies[0][0]
    assert tokens(engine, prompt_ids, 8) == tokens(engine, prompt_ids, 1) == replies[0][1]
    adaptation.close()
    engine.close()
