"""Several generations in flight (service/scheduler.py): the real server on a tiny random pair,
the official openai SDK. Each request's output equals its output alone; a short request ends
while a long one streams; a cancel mid-batch changes no other output; the batch's places admit
requests before any 429."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from service_support import LONG_PROMPT, make_pair, openai_client, wait_until

from dflash_local.service.scheduler import DEFAULT_MAX_BATCH, max_batch_for

MAX_BATCH = 3
# greedy speculative, greedy plain, seeded sampling: each must be the same beside the others.
# The sampled one drafts a fixed width: under auto the planner prices rounds by their measured
# time, so the widths, and with them the draws a seed gives, follow the machine's load.
REQUESTS = [
    {"prompt": "Write a poem.", "max_tokens": 40, "extra_body": {"speculative": True}},
    {"prompt": LONG_PROMPT, "max_tokens": 40, "extra_body": {"speculative": False}},
    {"prompt": "Tell me a story.", "max_tokens": 40, "temperature": 0.9, "seed": 7,
     "extra_body": {"speculative": True, "block_size": 4}},
]


def uncached_loader(engine: str, target: str, drafter: str | None, _options=None):
    """A TorchEngine without the prefix cache: a request alone and the same request in a batch
    both prefill their whole prompt."""
    from dflash_local.engines.torch_engine import TorchEngine

    assert engine == "transformers", engine
    return TorchEngine(Path(target), Path(drafter) if drafter else None, prefix_cache=False)


def start(pair, **state_options):
    from dflash_local.service.app import create_app
    from dflash_local.service.server import BackgroundServer
    from dflash_local.service.state import ServiceState

    state = ServiceState(loader=uncached_loader, **state_options)
    state.load("transformers", *pair, served_name="tiny")
    return state, BackgroundServer(create_app(state)).start()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def served(pair):
    state, server = start(pair, max_batch=MAX_BATCH)
    yield state, server
    server.stop()


def token_ids(client, prompt: str, **fields) -> list[int]:
    chunks = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], stream=True, **fields)
    return [t for chunk in chunks if chunk.choices for t in chunk.model_extra["dflash"]["token_ids"]]


def worker_status(server) -> dict:
    return httpx.get(server.url + "/dflash/status").json()["worker"]


def long_stream(server, http: httpx.Client):
    body = {"messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 900,
            "stream": True, "speculative": False}
    return http.stream("POST", server.url + "/v1/chat/completions", json=body)


def test_status_shows_the_batch(served):
    assert worker_status(served[1])["max_batch"] == MAX_BATCH


def test_concurrent_requests_equal_their_solo_outputs(served):
    client = openai_client(served[1])
    alone = [token_ids(client, **request) for request in REQUESTS]
    start_together = threading.Barrier(len(REQUESTS))

    def beside_the_others(request: dict) -> list[int]:
        start_together.wait()
        return token_ids(openai_client(served[1]), **request)

    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        together = list(pool.map(beside_the_others, REQUESTS))
    assert together == alone
    assert [len(ids) for ids in alone] == [40, 40, 40], [len(ids) for ids in alone]


def test_short_request_finishes_while_a_long_one_streams(served):
    state, server = served
    with httpx.Client(timeout=60) as http, long_stream(server, http) as running:
        lines = running.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        long_id = first.split('"id":"', 1)[1].split('"', 1)[0]
        reply = openai_client(server).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5)
        assert reply.usage.completion_tokens == 5
        running_ids = [job["id"] for job in worker_status(server)["running"]]
        assert long_id in running_ids  # the long stream had not finished: they interleaved
    wait_until(lambda: not state.loaded.worker.busy, timeout=60)


def test_cancel_mid_batch_leaves_the_others_unchanged(served):
    state, server = served
    request = REQUESTS[2]
    alone = token_ids(openai_client(server), **request)
    first_chunk = threading.Event()
    client = openai_client(server)

    def beside_a_cancel() -> list[int]:
        chunks = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": request["prompt"]}], stream=True,
            max_tokens=request["max_tokens"], temperature=request["temperature"],
            seed=request["seed"], extra_body=request["extra_body"])
        ids = []
        for chunk in chunks:
            first_chunk.set()
            ids += chunk.model_extra["dflash"]["token_ids"] if chunk.choices else []
        return ids

    with ThreadPoolExecutor(1) as pool, httpx.Client(timeout=60) as http:
        with long_stream(server, http) as cancelled:
            lines = cancelled.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            beside = pool.submit(beside_a_cancel)
            assert first_chunk.wait(60)
        # the long stream's connection is closed here, mid-batch
        assert beside.result() == alone
    wait_until(lambda: not state.loaded.worker.busy, timeout=60)
    assert state.loaded.worker.status()["jobs_done"] >= 3


def test_no_429_while_the_batch_has_room(pair):
    _state, server = start(pair, max_batch=2, max_queue=1)
    try:
        with httpx.Client(timeout=60) as http, long_stream(server, http) as running:
            lines = running.iter_lines()
            next(line for line in lines if line.startswith("data: "))

            def short(_index: int) -> int:
                return httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
                    "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}).status_code

            # one takes the free place, one waits in the queue: one place each, no 429
            with ThreadPoolExecutor(2) as pool:
                assert list(pool.map(short, range(2))) == [200, 200]
    finally:
        server.stop()


def test_eight_clients_none_starves_none_refused(pair):
    """8 clients at once, 8 places and no queue: each gets its place (no 429), and each has its
    first token before any reply ends (plain, a token a round: none waits for another to end)."""
    _state, server = start(pair, max_batch=8, max_queue=0)
    start_together = threading.Barrier(8)

    def client(index: int) -> tuple[int, float, float, int]:
        body = {"messages": [{"role": "user", "content": f"Count to {index + 3}."}],
                "max_tokens": 30, "stream": True, "speculative": False}
        start_together.wait()
        first, tokens = None, 0
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                          timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: {") and (chunk := json.loads(line[6:])).get("choices"):
                    tokens += len(chunk["dflash"]["token_ids"])
                    first = first or time.perf_counter()
        return response.status_code, first, time.perf_counter(), tokens

    try:
        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(client, range(8)))
    finally:
        server.stop()
    assert [status for status, *_ in replies] == [200] * 8
    assert all(tokens > 8 for *_, tokens in replies), replies  # each outlasts 8 joiners' turns
    assert max(first for _, first, _, _ in replies) < min(end for _, _, end, _ in replies)


def test_the_heap_goes_back_once_the_batch_drains(served, monkeypatch):
    """The worker gives the freed heap back (service/heap.py) once nothing runs: after the
    batch drains, never with a lane in flight."""
    from dflash_local.service import worker as worker_module

    state, server = served
    worker, lanes_at_trims = state.loaded.worker, []
    monkeypatch.setattr(worker_module, "trim_heap",
                        lambda: lanes_at_trims.append(len(worker._batch.lanes)) or True)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda request: token_ids(openai_client(server), **request), REQUESTS[:2]))
    wait_until(lambda: lanes_at_trims and not worker.busy, timeout=60)
    assert set(lanes_at_trims) == {0}, lanes_at_trims


def test_max_batch_refused_below_one_and_past_memory(served):
    engine = served[0].loaded.engine
    each = engine.generation_bytes()
    with pytest.raises(Exception, match="--max-batch must be >= 1, got 0"):
        max_batch_for(engine, 0, 64 * each)
    with pytest.raises(Exception, match=r"--max-batch 9: .* memory of .* GiB \(it holds 2\)"):
        max_batch_for(engine, 9, 2 * each + 1)
    assert max_batch_for(engine, None, 2 * each) == 2  # the default, as memory holds
    assert max_batch_for(engine, None, 64 * each) == DEFAULT_MAX_BATCH
    assert max_batch_for(engine, 9, 9 * each) == 9


def test_a_served_engine_runs_one_at_a_time(served):
    from dataclasses import replace

    class Served:  # what max_batch_for reads of a served engine: it does not tokenize
        capabilities = replace(served[0].loaded.engine.capabilities, tokenizes=False)

    assert max_batch_for(Served(), 8, 1) == 1
