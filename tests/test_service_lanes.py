"""The worker's lanes (service/lanes.py) on the real server and a tiny random pair: verifies
batched through a runner class's `verify_batch` and drafter calls through a drafter class's
`propose_batch` / `propose_tree_batch` where it has them, one by one where it has none, each
request's output its output alone either way; a long prompt prefills in chunks with the
running stream's rounds between them (the observed order of calls, not timing); a request
cancelled while its prompt prefills leaves before its next chunk, the stream beside it unchanged."""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from service_support import LONG_PROMPT, make_pair, openai_client, wait_until
from test_service_batch import REQUESTS, long_stream, start, token_ids

from dflash_local.method import shared_rounds

CHUNK_ROWS = 16  # a prompt of LONG_IDS rows prefills in many chunks
LONG_IDS = [5 + i % 200 for i in range(160)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    state, server = start(make_pair(tmp_path_factory.mktemp("pair")), max_batch=3)
    yield state, server
    server.stop()


@pytest.fixture
def calls(monkeypatch):
    """Every prefill and verify the Transformers runners run, in order: (kind, runner, rows)."""
    from dflash_local.engines.torch_engine import TorchTargetRunner

    monkeypatch.setattr(shared_rounds, "PREFILL_CHUNK_ROWS", CHUNK_ROWS)
    log: list[tuple[str, int, int]] = []
    prefill, verify = TorchTargetRunner.prefill, TorchTargetRunner.verify

    def logged_prefill(self, prompt_ids, start=0):
        log.append(("prefill", id(self), len(prompt_ids) - start))
        return prefill(self, prompt_ids, start)

    def logged_verify(self, anchor_id, tree):
        log.append(("verify", id(self), len(tree.token_ids) + 1))
        return verify(self, anchor_id, tree)

    monkeypatch.setattr(TorchTargetRunner, "prefill", logged_prefill)
    monkeypatch.setattr(TorchTargetRunner, "verify", logged_verify)
    return log


def together(server, requests: list[dict] = REQUESTS) -> list[list[int]]:
    start_together = threading.Barrier(len(requests))

    def beside_the_others(request: dict) -> list[int]:
        start_together.wait()
        return token_ids(openai_client(server), **request)

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(beside_the_others, requests))


@pytest.mark.parametrize("runner_batches", [True, False], ids=["verify_batch", "one-by-one"])
def test_outputs_beside_others_equal_alone_with_or_without_verify_batch(served, monkeypatch,
                                                                       runner_batches):
    from dflash_local.engines.torch_engine import TorchTargetRunner

    batch_sizes: list[int] = []
    if runner_batches:  # the class's own batched verify where it has one, counted
        own = getattr(TorchTargetRunner, "verify_batch", shared_rounds.verify_each)

        def counted(runners, anchor_ids, trees):
            batch_sizes.append(len(runners))
            return own(runners, anchor_ids, trees)

        monkeypatch.setattr(TorchTargetRunner, "verify_batch", staticmethod(counted), raising=False)
    else:
        monkeypatch.delattr(TorchTargetRunner, "verify_batch", raising=False)
    client = openai_client(served[1])
    alone = [token_ids(client, **request) for request in REQUESTS]
    assert together(served[1]) == alone
    if runner_batches:
        assert max(batch_sizes) == len(REQUESTS), batch_sizes  # every lane's verify in one call
    worker = served[0].loaded.worker.status()
    assert worker["verifies"] > worker["verify_batches"]  # some batches held several lanes


# fixed widths, so every round drafts: two lanes' trees (one sampled) and one lane's chain
DRAFTING = [
    {"prompt": "Write a poem.", "max_tokens": 30, "extra_body": {"block_size": 4}},
    {"prompt": "Tell me a story.", "max_tokens": 30, "temperature": 0.9, "seed": 7,
     "extra_body": {"block_size": 5}},
    {"prompt": LONG_PROMPT, "max_tokens": 30, "extra_body": {"block_size": 3, "tree": False}},
]


@pytest.mark.parametrize("drafter_batches", [True, False], ids=["propose_batch", "one-by-one"])
def test_outputs_beside_others_equal_alone_with_or_without_propose_batch(served, monkeypatch,
                                                                         drafter_batches):
    from dflash_local.drafter.model_torch import DraftSession

    batch_sizes: list[int] = []
    for name in ("propose_batch", "propose_tree_batch"):
        if drafter_batches:  # the class's own batched pass, counted
            monkeypatch.setattr(DraftSession, name, staticmethod(_counted(getattr(DraftSession, name),
                                                                          batch_sizes)))
        else:
            monkeypatch.delattr(DraftSession, name)
    worker = served[0].loaded.worker
    before = worker.status()
    client = openai_client(served[1])
    alone = [token_ids(client, **request) for request in DRAFTING]
    assert together(served[1], DRAFTING) == alone
    status = worker.status()
    proposals = status["proposals"] - before["proposals"]
    proposal_batches = status["proposal_batches"] - before["proposal_batches"]
    assert proposals > proposal_batches > 0  # some ticks gathered several lanes' calls
    if drafter_batches:  # the trees of two lanes in one pass, and every call went through one
        assert max(batch_sizes) == 2, batch_sizes
        assert sum(batch_sizes) == proposals
    else:
        assert batch_sizes == []


def _counted(batch, batch_sizes: list[int]):
    def counted(sessions, anchors, new_taps, sizes):
        batch_sizes.append(len(sessions))
        return batch(sessions, anchors, new_taps, sizes)
    return counted


def _newcomer(server, http: httpx.Client, max_tokens: int = 4):
    body = {"prompt": LONG_IDS, "max_tokens": max_tokens, "stream": True, "temperature": 0}
    return http.stream("POST", server.url + "/v1/completions", json=body)


def test_a_long_prefill_takes_turns_with_a_running_stream(served, calls):
    state, server = served
    with httpx.Client(timeout=60) as http, long_stream(server, http) as running:
        lines = running.iter_lines()  # kept: a dropped iterator closes the stream
        next(line for line in lines if line.startswith("data: "))
        stream_runner = wait_until(lambda: next((runner for kind, runner, _ in calls
                                                 if kind == "verify"), None))
        joined_at = len(calls)
        with _newcomer(server, http) as newcomer:
            assert newcomer.status_code == 200
            list(newcomer.iter_lines())
        later = calls[joined_at:]
    chunks = [i for i, (kind, runner, _) in enumerate(later)
              if kind == "prefill" and runner != stream_runner]
    assert len(chunks) == -(-len(LONG_IDS) // CHUNK_ROWS), later
    assert all(later[i][2] <= CHUNK_ROWS for i in chunks)
    for before, after in itertools.pairwise(chunks):  # the stream's round between every two chunks
        assert ("verify", stream_runner) in [(kind, runner) for kind, runner, _ in later[before:after]]
    wait_until(lambda: not state.loaded.worker.busy, timeout=60)


def test_cancel_while_prefilling_leaves_before_the_next_chunk(served, calls, monkeypatch):
    from dflash_local.engines.torch_engine import TorchTargetRunner

    state, server = served
    worker = state.loaded.worker
    request = REQUESTS[2]
    alone = token_ids(openai_client(server), **request)
    prefill, cancelled, newcomer_runners = TorchTargetRunner.prefill, [], set()

    def cancel_at_the_third_chunk(self, prompt_ids, start=0):  # the client leaves, mid-prefill
        logits_taps = prefill(self, prompt_ids, start)
        if list(prompt_ids) == LONG_IDS[: len(prompt_ids)]:
            newcomer_runners.add(id(self))
        if id(self) in newcomer_runners and start == 2 * CHUNK_ROWS:
            job = next(lane.job for lane in worker._batch.lanes if lane.job.prompt_ids == LONG_IDS)
            job.cancel()
            cancelled.append(job)
        return logits_taps

    monkeypatch.setattr(TorchTargetRunner, "prefill", cancel_at_the_third_chunk)
    with ThreadPoolExecutor(1) as pool, httpx.Client(timeout=60) as http:
        beside = pool.submit(token_ids, openai_client(server), **request)
        with _newcomer(server, http, max_tokens=50) as newcomer:
            list(newcomer.iter_lines())
        assert beside.result() == alone
    [job] = cancelled
    assert job.outcome == "cancelled" and job.reply_ids == []  # it left before its first token
    newcomer_chunks = [rows for kind, runner, rows in calls
                       if kind == "prefill" and runner in newcomer_runners]
    assert newcomer_chunks == [CHUNK_ROWS] * 3  # the pause before its fourth chunk was its last
    wait_until(lambda: not worker.busy, timeout=60)


AUTO = [{"prompt": prompt, "max_tokens": 30, "extra_body": {"block_size": "auto"}}
        for prompt in ("Write a poem.", "Tell me a story.", LONG_PROMPT)]


def test_each_lanes_planner_prices_its_rounds_by_the_lanes_in_flight(served, monkeypatch):
    """The worker's lanes tell each generation's auto planner how many lanes share the batch
    (alone: 1; three together: 3), and split the batches' time by the calibration's batch
    prices; each greedy reply stays its reply alone, whatever widths those prices chose."""
    from dflash_local.method.calibration import Calibration
    from dflash_local.method.planning.costs import BatchCosts, LinearCost, RoundCosts

    state, server = served
    engine = state.loaded.engine
    widths = range(1, engine.pair.drafter_block + 1)
    verify, draft = LinearCost(0.05, 0.004), LinearCost(0.02, 0.001)
    batch = BatchCosts(verify, draft)
    costs = RoundCosts(tuple(verify.seconds(w) + (draft.seconds(w) if w > 1 else 0) for w in widths),
                       tuple(verify.seconds(w) for w in widths), timed=True, batch=batch)
    monkeypatch.setattr(engine, "calibration", Calibration(costs, (0.7,) * (len(widths) - 1), {},
                                                           "now", 0.0))
    lanes_seen: list[int] = []
    in_batch = RoundCosts.in_batch
    monkeypatch.setattr(RoundCosts, "in_batch",
                        lambda self, lanes: lanes_seen.append(lanes) or in_batch(self, lanes))
    client = openai_client(server)
    alone = [token_ids(client, **request) for request in AUTO]
    assert lanes_seen and set(lanes_seen) == {1}
    lanes_seen.clear()
    assert together(server, AUTO) == alone
    assert max(lanes_seen) == len(AUTO), lanes_seen
    assert state.loaded.worker._lanes.batch_costs() is batch  # the split's prices: the calibration's
