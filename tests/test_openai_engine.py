"""The OpenAI-compatible engine, for real over HTTP on 127.0.0.1.

Against our own service (uvicorn, a tiny random pair): the remote stream equals the local engine's,
round for round, with exact per-step statistics; closing the iterator cancels the server's job;
server errors arrive as ours. Against a stand-in for vLLM and SGLang (a real FastAPI/uvicorn server
streaming real SSE, and a /metrics page in the Prometheus text format with vLLM's own counter
names): acceptance comes from counter deltas around the request, or from SGLang's details.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from dataclasses import replace
from typing import Self

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from dflash_local.engines.openai_endpoint import SERVER_SIDE_DRAFTER
from dflash_local.engines.openai_engine import RemoteEngine
from dflash_local.engines.server_flags import parse_prometheus
from dflash_local.errors import (
    EngineUnavailableError,
    InvalidRequestError,
    ModelNotFoundError,
    PromptTooLongError,
)
from dflash_local.events import GenerationParams, GenerationStats, OutputConstraint
from dflash_local.service.server import BackgroundServer

MESSAGES = [{"role": "user", "content": "Tell me a long story."}]
K = 7  # the stand-in's num_speculative_tokens (B = 8)
# one list per engine step: the prefill's token, then rounds of accepted drafts + the bonus
STEPS = [[10], [11, 12, 13], [14], [15, 16, 17, 18, 19, 20, 21, 22], [23, 24]]


# --- a vLLM / SGLang stand-in ---

class StandIn:
    """Streams STEPS the way the server kind does and counts them in its Prometheus counters."""

    def __init__(self, kind: str = "vllm", speculative: bool = True, sglang_details: bool = True,
                 coalesce: bool = False, api_key: str | None = None):
        self.kind, self.speculative, self.details = kind, speculative, sglang_details
        self.coalesce, self.api_key = coalesce, api_key
        # traffic before ours: deltas must not include it
        self.counters = {"drafts": 40.0, "draft_tokens": 280.0, "accepted": 90.0,
                         "per_pos": [30.0, 25.0, 15.0, 10.0, 5.0, 3.0, 2.0], "verify": 40.0, "gen": 170.0}
        self.requests: list[dict] = []
        self.first_chunk_gate: threading.Event | None = None  # set: the stream may begin
        self.cached: int | None = None  # prompt_tokens_details.cached_tokens of the final usage
        self.server = BackgroundServer(self.app())

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.middleware("http")
        async def auth(request: Request, call_next):
            if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
                return JSONResponse({"error": {"message": "Unauthorized", "type": "Unauthorized",
                                               "code": 401}}, status_code=401)
            return await call_next(request)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "tiny-served", "object": "model",
                                                "owned_by": self.kind, "max_model_len": 4096}]}

        @app.get("/get_server_info")
        async def server_info():
            spec = self.speculative
            return {"speculative_algorithm": "DFLASH" if spec else None,
                    "speculative_num_draft_tokens": K + 1 if spec else None}

        @app.get("/metrics")
        async def metrics():
            return PlainTextResponse(self.exposition(), media_type="text/plain; version=0.0.4")

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            self.requests.append(body)
            text = body["messages"][-1]["content"]
            if text == "too long":  # vLLM's error body, verbatim shape
                return JSONResponse({"error": {"message": "This model's maximum context length is "
                                               "4096 tokens. However, you requested 9000 tokens.",
                                               "type": "BadRequestError", "param": None, "code": 400}},
                                    status_code=400)
            if text == "old error shape":  # older vLLM: the error fields at the top level
                return JSONResponse({"object": "error", "message": "temperature must be >= 0",
                                     "type": "BadRequestError", "code": 400}, status_code=400)
            return StreamingResponse(self.sse(body, fail=text == "fail midway"),
                                     media_type="text/event-stream")

        return app

    async def sse(self, body: dict, fail: bool):
        steps = [STEPS[0], STEPS[1] + STEPS[2], *STEPS[3:]] if self.coalesce else STEPS
        usage_each = body.get("stream_options", {}).get("continuous_usage_stats")
        done = 0

        def chunk(choices, **extra):
            return "data: " + json.dumps({"id": "cmpl-1", "object": "chat.completion.chunk",
                                          "model": "tiny-served", "choices": choices, **extra}) + "\n\n"

        while self.first_chunk_gate is not None and not self.first_chunk_gate.is_set():
            await asyncio.sleep(0.01)  # the prefill, held
        yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        for index, step in enumerate(steps):
            await asyncio.sleep(0.01)
            if fail and index == 2:
                yield "data: " + json.dumps({"error": {"message": "engine core died", "code": 500}}) + "\n\n"
                return
            done += len(step)
            choice = {"index": 0, "delta": {"content": "".join(chr(97 + t % 26) for t in step)},
                      "finish_reason": None}
            if body.get("return_token_ids"):
                choice["token_ids"] = step
            extra = {"usage": {"prompt_tokens": 9, "completion_tokens": done}} if usage_each else {}
            yield chunk([choice], **extra)
        yield chunk([{"index": 0, "delta": {}, "finish_reason": "length"}])
        if self.kind == "sglang" and self.details and body.get("return_spec_tokens_details"):
            rounds = len(STEPS) - 1
            accepted = sum(len(s) - 1 for s in STEPS[1:])
            yield chunk([], sglext={"spec_tokens_details": {
                "spec_verify_ct": rounds, "spec_num_correct_drafts": accepted,
                "spec_num_proposed_drafts": rounds * K, "spec_accept_length": done / rounds}})
        usage = {"prompt_tokens": 9, "completion_tokens": done, "total_tokens": 9 + done}
        if self.cached is not None:  # vLLM writes the details only with its flag (None: absent)
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached}
        yield chunk([], usage=usage)
        yield "data: [DONE]\n\n"
        asyncio.get_running_loop().call_later(0.15, self.count, body)  # counted a little late

    def count(self, body: dict) -> None:
        if not self.speculative:
            return
        for step in STEPS[1:]:
            accepted = len(step) - 1
            self.counters["drafts"] += 1
            self.counters["draft_tokens"] += K
            self.counters["accepted"] += accepted
            for position in range(accepted):
                self.counters["per_pos"][position] += 1
            self.counters["verify"] += 1
        self.counters["gen"] += sum(len(step) for step in STEPS)

    def exposition(self) -> str:
        """What prometheus_client's generate_latest writes for these families (text format 0.0.4)."""
        labels = 'model_name="tiny-served",engine="0"'
        out = ["# HELP python_gc_objects_collected_total Objects collected during gc",
               "# TYPE python_gc_objects_collected_total counter",
               'python_gc_objects_collected_total{generation="0"} 1234.0',
               "# HELP vllm:num_requests_running Number of requests in model execution batches.",
               "# TYPE vllm:num_requests_running gauge",
               f"vllm:num_requests_running{{{labels}}} 0.0"]
        if not self.speculative:
            return "\n".join(out) + "\n"
        c = self.counters
        families = [("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", c["drafts"]),
                    ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", c["draft_tokens"]),
                    ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", c["accepted"])]
        for name, doc, value in families:
            out += [f"# HELP {name}_total {doc}", f"# TYPE {name}_total counter",
                    f"{name}_total{{{labels}}} {value!r}",
                    f"# HELP {name}_created {doc}", f"# TYPE {name}_created gauge",
                    f"{name}_created{{{labels}}} 1.7331e+09"]
        name = "vllm:spec_decode_num_accepted_tokens_per_pos"
        out += [f"# HELP {name}_total Accepted tokens per draft position.",
                f"# TYPE {name}_total counter"]
        out += [f'{name}_total{{{labels},position="{p}"}} {v!r}' for p, v in enumerate(c["per_pos"])]
        if self.kind == "sglang":
            out += ["# HELP sglang:spec_verify_calls_total Number of speculative decoding verification calls.",
                    "# TYPE sglang:spec_verify_calls_total counter",
                    f'sglang:spec_verify_calls_total{{model_name="tiny-served"}} {c["verify"]!r}',
                    "# HELP sglang:generation_tokens_total Number of generation tokens processed.",
                    "# TYPE sglang:generation_tokens_total counter",
                    f'sglang:generation_tokens_total{{model_name="tiny-served",is_streaming="true"}} {c["gen"]!r}']
        return "\n".join(out) + "\n"

    def __enter__(self) -> Self:
        self.server.start()
        self.url = self.server.url
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop()


@pytest.fixture
def vllm_stand_in():
    with StandIn("vllm") as server:
        yield server


def test_the_exposition_parses_with_vllms_counter_names(vllm_stand_in):
    samples = parse_prometheus(vllm_stand_in.exposition())
    names = {name for name, _, _ in samples}
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total" in names
    per_pos = [(labels["position"], value) for name, labels, value in samples
               if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"]
    assert per_pos[0] == ("0", 30.0) and len(per_pos) == K


def test_vllm_acceptance_is_the_counter_delta_around_the_request(vllm_stand_in):
    engine = RemoteEngine(vllm_stand_in.url)
    assert (engine.main.kind, engine.pair.drafter, engine.pair.drafter_block) == ("vllm", SERVER_SIDE_DRAFTER, K + 1)
    assert not engine.capabilities.speculative_toggle and not engine.capabilities.block_size_per_request
    events = list(engine.stream_chat(MESSAGES, GenerationParams(max_tokens=20)))
    assert vllm_stand_in.requests[-1]["return_token_ids"] is True
    assert [list(e.token_ids) for e in events] == STEPS
    assert [e.accepted for e in events] == [0] + [len(s) - 1 for s in STEPS[1:]]
    assert [e.round_index for e in events] == list(range(len(STEPS)))
    assert events[0].prompt_tokens == 9 and events[-1].finish_reason == "length"
    stats = engine.last_stats
    rounds, accepted = len(STEPS) - 1, sum(len(s) - 1 for s in STEPS[1:])
    assert (stats.source, stats.rounds, stats.drafted, stats.accepted) == ("vllm-metrics", rounds, rounds * K, accepted)
    assert stats.accepted_per_position == [sum(len(s) - 1 > p for s in STEPS[1:]) for p in range(K)]
    assert stats.per_round_exact and stats.tau == pytest.approx(1 + accepted / rounds)
    assert stats.completion_tokens == sum(map(len, STEPS)) and stats.prompt_tokens == 9
    local = GenerationStats()
    for event in events:
        local.add(event)
    assert (local.rounds, local.accepted, local.tau) == (rounds, accepted, pytest.approx(stats.tau))
    engine.close()


def test_coalesced_chunks_keep_the_server_totals_and_say_rounds_are_inexact():
    with StandIn("vllm", coalesce=True) as server:
        engine = RemoteEngine(server.url)
        list(engine.stream_chat(MESSAGES, GenerationParams(max_tokens=20)))
        stats = engine.last_stats
        assert stats.rounds == len(STEPS) - 1 and not stats.per_round_exact
        engine.close()


def test_speculation_off_needs_a_plain_server(vllm_stand_in):
    engine = RemoteEngine(vllm_stand_in.url)
    with pytest.raises(InvalidRequestError, match="--plain-base-url"):
        engine.stream_chat(MESSAGES, GenerationParams(speculative=False))
    with StandIn("vllm", speculative=False) as plain:
        engine = RemoteEngine(vllm_stand_in.url, plain_base_url=plain.url)
        assert engine.capabilities.speculative_toggle
        events = list(engine.stream_chat(MESSAGES, GenerationParams(speculative=False)))
        assert len(plain.requests) == 1 and len(vllm_stand_in.requests) == 0
        assert {e.width for e in events} == {1} and sum(e.accepted for e in events) == 0
        assert engine.last_stats.source == "none"
        engine.close()


@pytest.mark.parametrize("details", [True, False], ids=["details", "metrics"])
def test_sglang_acceptance_from_details_or_counters(details):
    with StandIn("sglang", sglang_details=details) as server:
        engine = RemoteEngine(server.url)
        assert engine.pair.drafter_block == K + 1
        events = list(engine.stream_chat(MESSAGES, GenerationParams(max_tokens=20)))
        assert server.requests[-1]["return_spec_tokens_details"] is True
        assert "".join(e.text for e in events) == "".join(chr(97 + t % 26) for s in STEPS for t in s)
        stats = engine.last_stats
        rounds, accepted = len(STEPS) - 1, sum(len(s) - 1 for s in STEPS[1:])
        assert stats.source == ("sglang-details" if details else "sglang-metrics")
        assert (stats.rounds, stats.accepted, stats.drafted) == (rounds, accepted, rounds * K)
        assert stats.per_round_exact  # counted from the continuous usage, one chunk per step
        engine.close()


def test_server_errors_arrive_as_ours(vllm_stand_in):
    engine = RemoteEngine(vllm_stand_in.url)
    with pytest.raises(PromptTooLongError, match="maximum context length is 4096"):
        next(engine.stream_chat([{"role": "user", "content": "too long"}], GenerationParams()))
    with pytest.raises(InvalidRequestError, match="temperature must be >= 0"):
        next(engine.stream_chat([{"role": "user", "content": "old error shape"}], GenerationParams()))
    stream = engine.stream_chat([{"role": "user", "content": "fail midway"}], GenerationParams())
    with pytest.raises(EngineUnavailableError, match="engine core died"):
        list(stream)
    with pytest.raises(ModelNotFoundError, match="serves: tiny-served"):
        RemoteEngine(vllm_stand_in.url, model="other")
    engine.close()


def test_bench_takes_a_vllm_servers_acceptance_from_its_counters(tmp_path, capsys):
    """Coalesced chunks: rounds cannot be told apart, so τ is the counters' totals."""
    from dflash_local.cli.main import main

    with StandIn("vllm", coalesce=True) as server, StandIn("vllm", speculative=False) as plain:
        assert main(["bench", "--engine", "openai", "--base-url", server.url, "--plain-base-url",
                     plain.url, "--dataset", "adversarial", "--max-samples", "1",
                     "--max-tokens", "20", "--out", str(tmp_path)]) == 0
    record = json.loads(next(tmp_path.glob("*.json")).read_text())
    methods = record["datasets"]["adversarial"]["methods"]
    assert list(methods) == ["plain", f"dflash (server, B={K + 1})"]
    served = methods[f"dflash (server, B={K + 1})"]
    rounds, accepted = len(STEPS) - 1, sum(len(s) - 1 for s in STEPS[1:])
    assert served["acceptance_source"] == "vllm-metrics" and "acceptance_histogram" not in served
    assert served["tau"] == pytest.approx(1 + accepted / rounds, abs=1e-4)
    sample = record["datasets"]["adversarial"]["samples"][0]
    assert sample["identical_to_plain"] == {f"dflash (server, B={K + 1})": True}
    assert sample["methods"]["plain"]["completion_tokens"] == sum(map(len, STEPS))
    assert len(server.requests) == len(plain.requests) == 2  # warm-up and the one sample


def test_a_wrong_key_or_no_server_is_engine_unavailable():
    with StandIn("vllm", api_key="sesame") as server:
        with pytest.raises(EngineUnavailableError, match="401.*Unauthorized"):
            RemoteEngine(server.url, api_key="wrong")
        RemoteEngine(server.url, api_key="sesame").close()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(EngineUnavailableError, match="cannot reach"):
        RemoteEngine(f"http://127.0.0.1:{port}")


# --- against our own service ---

@pytest.fixture(scope="module")
def service(tmp_path_factory):
    from service_support import serve_module

    yield from serve_module(tmp_path_factory)


@pytest.fixture(scope="module")
def remote(service):
    engine = RemoteEngine(service[1].url + "/v1", model="tiny")
    yield engine
    engine.close()


def local_events(state, params: GenerationParams, messages=MESSAGES):
    engine = state.loaded.engine
    return list(engine.stream(engine.encode_chat(messages), params))


# the tiny pair's greedy answer to it repeats itself: prompt-lookup rounds copy some of it
COPYING_MESSAGES = [{"role": "user", "content": "Repeat after me: " + "alpha beta gamma delta " * 3}]


@pytest.mark.parametrize("speculative", [True, False])
def test_remote_stream_equals_the_local_engines_round_for_round(service, remote, speculative,
                                                               monkeypatch):
    from dflash_local.method.planning.auto import AutoPlanner

    # auto's widths also follow the round times it observes, which differ run to run: here it
    # plans from the calibration and the drafts alone, the same for both runs
    observe = AutoPlanner.observe
    monkeypatch.setattr(AutoPlanner, "observe", lambda planner, draft, path, committed, seconds=None:
                        observe(planner, draft, path, committed, None))
    params = GenerationParams(max_tokens=48, speculative=speculative)
    events = list(remote.stream_chat(COPYING_MESSAGES, params))
    # the service gives a request with no block size its default ("auto" for a local pair)
    local = local_events(service[0], replace(params, block_size=service[0].loaded.default_block_size),
                         COPYING_MESSAGES)
    fields = ("token_ids", "drafted", "draft_depth", "accepted", "lookup_accepted", "accepted_chars",
              "lookup_accepted_chars", "round_index", "width", "mode")
    assert [[getattr(e, f) for f in fields] for e in events] == [[getattr(e, f) for f in fields] for e in local]
    assert "".join(e.text for e in events) == "".join(e.text for e in local)
    if speculative:  # the lookup fields made the trip with something in them
        assert sum(e.lookup_accepted for e in local) > 0 and sum(e.lookup_accepted_chars for e in local) > 0
    stats = remote.last_stats
    assert stats.source == "dflash" and stats.per_round_exact
    assert stats.completion_tokens == 48 and stats.prompt_tokens > 0
    assert stats.accepted == sum(e.accepted for e in local) and stats.rounds == len(local) - 1


def test_the_servers_cached_tokens_reach_the_stats(service, remote):
    """usage.prompt_tokens_details.cached_tokens, as the server counts its prefix cache's rows."""
    service[0].loaded.engine.prefix_cache.clear()  # earlier tests' prompts share the template's start
    talk = [{"role": "user", "content": "A first turn only this test sends."}]
    params = GenerationParams(max_tokens=8)
    reply = "".join(event.text for event in remote.stream_chat(talk, params))
    first = remote.last_stats
    assert first.cached_tokens == 0 and first.prompt_tokens > 0
    talk += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
    list(remote.stream_chat(talk, params))
    second = remote.last_stats
    assert first.prompt_tokens <= second.cached_tokens < second.prompt_tokens


def test_a_vllm_servers_usage_without_details_is_no_cache_hit(vllm_stand_in):
    engine = RemoteEngine(vllm_stand_in.url + "/v1")
    try:
        list(engine.stream_chat(MESSAGES, GenerationParams(max_tokens=16)))
        assert engine.last_stats.cached_tokens == 0 and engine.last_stats.prompt_tokens == 9
        vllm_stand_in.cached = 6  # launched with --enable-prompt-tokens-details
        list(engine.stream_chat(MESSAGES, GenerationParams(max_tokens=16)))
        assert engine.last_stats.cached_tokens == 6
    finally:
        engine.close()


def test_own_service_capabilities(service, remote):
    assert remote.main.kind == "dflash-local" and remote.pair.drafter_block == 8
    assert remote.capabilities.speculative_toggle and remote.capabilities.block_size_per_request
    assert remote.pair.drafter is not None
    # the server's vocabulary is its own: unknown here, known to the local engine it relays
    assert remote.token_id_limit is None
    local = service[0].loaded.engine
    assert local.token_id_limit == min(len(local.tokenizer), local.model.get_input_embeddings().num_embeddings)


def test_closing_the_stream_cancels_the_servers_job(service, remote):
    from service_support import wait_until

    worker = service[0].loaded.worker
    stream = remote.stream_chat(MESSAGES, GenerationParams(max_tokens=900))
    first = [next(stream), next(stream)]
    assert all(e.token_ids for e in first)
    stream.close()
    job = wait_until(lambda: worker.last if worker.last and not worker.busy else None)
    assert job.outcome == "cancelled" and job.rounds < 300


def test_own_service_errors_arrive_as_ours(remote):
    # a max_tokens past the room is fitted to it; a prompt that leaves no room is refused
    too_long = [{"role": "user", "content": "many words " * 20_000}]
    with pytest.raises(PromptTooLongError, match="context"):
        list(remote.stream_chat(too_long, GenerationParams(max_tokens=16)))
    with pytest.raises(InvalidRequestError, match="temperature"):
        list(remote.stream_chat(MESSAGES, GenerationParams(temperature=3.0)))


def test_a_service_relaying_our_service_streams_the_same_reply(service):
    """`dflash-local serve --engine openai --base-url ...`: the relay's worker takes messages
    (the remote server templates and tokenizes), and its answers equal the origin's."""
    import httpx

    from dflash_local.service.app import create_app
    from dflash_local.service.state import ServiceState

    relay = ServiceState()
    relay.load("openai", service[1].url + "/v1", None, served_name="relay")
    server = BackgroundServer(create_app(relay)).start()
    try:
        body = {"messages": MESSAGES, "max_tokens": 16}
        origin = httpx.post(service[1].url + "/v1/chat/completions", timeout=60,
                            json={**body, "model": "tiny"}).json()
        relayed = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                             json={**body, "model": "relay"}).json()
        assert relayed["choices"][0]["message"]["content"] == origin["choices"][0]["message"]["content"]
        assert relayed["usage"]["completion_tokens"] == 16
        assert relayed["usage"]["prompt_tokens"] == origin["usage"]["prompt_tokens"] > 0
        assert relayed["usage"]["dflash"]["accepted"] == origin["usage"]["dflash"]["accepted"]
        # the origin kept the same prompt: the relay reports the origin's cache hit as its own
        assert relayed["usage"]["prompt_tokens_details"]["cached_tokens"] == \
            origin["usage"]["prompt_tokens"] - 1
        plain = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                           json={**body, "model": "relay", "speculative": False}).json()
        assert plain["usage"]["dflash"]["drafted"] == 0
        assert plain["choices"][0]["message"]["content"] == origin["choices"][0]["message"]["content"]
        refused = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                             json={**body, "model": "relay", "logprobs": True})
        assert refused.status_code == 400  # the relay cannot map the origin's strings to ids
        message = refused.json()["error"]["message"]
        assert "logprobs: true is not supported by this engine" in message
    finally:
        server.stop()
        relay.shutdown()


def test_a_relayed_jobs_phase_is_prefill_until_the_servers_first_token(vllm_stand_in):
    """/dflash/status says a relayed job waits on its server's prefill, not that it decodes."""
    import httpx
    from service_support import wait_until

    from dflash_local.service.app import create_app
    from dflash_local.service.state import ServiceState

    vllm_stand_in.first_chunk_gate = threading.Event()
    relay = ServiceState()
    relay.load("openai", vllm_stand_in.url + "/v1", None, served_name="relay")
    server = BackgroundServer(create_app(relay)).start()
    body = {"model": "relay", "messages": MESSAGES, "max_tokens": 16}
    sent = threading.Thread(target=httpx.post, args=(server.url + "/v1/chat/completions",),
                            kwargs={"json": body, "timeout": 60})
    try:
        sent.start()
        running = wait_until(lambda: httpx.get(server.url + "/dflash/status").json()["worker"]["running"])
        assert running[0]["phase"] == "prefill", running
    finally:
        vllm_stand_in.first_chunk_gate.set()
        sent.join()
        server.stop()
        relay.shutdown()


def test_serve_flags_reach_only_the_engine_they_were_given_for():
    """`serve --engine openai --remote-api-key K` then POST /dflash/load of a local pair: the
    local engine gets --dtype only, never the relay's keyword options (that was a TypeError)."""
    from dflash_local.cli.main import build_parser
    from dflash_local.cli.options import serve_options
    from dflash_local.engines.options import EngineOptions
    from dflash_local.service.api_errors import LoadFailedError
    from dflash_local.service.state import ServiceState

    args = build_parser().parse_args(["serve", "--engine", "openai", "--base-url", "http://127.0.0.1:9",
                                      "--remote-api-key", "k", "--dtype", "float32"])
    calls = []

    class Recorded(Exception):
        pass

    def loader(engine, target, drafter, options):
        calls.append((engine, options))
        raise Recorded

    state = ServiceState(loader=loader, load_options=serve_options(args))
    for engine in ("openai", "transformers", "vllm"):
        with pytest.raises(LoadFailedError, match="Recorded"):  # a loader's own error, reported
            state.load(engine, "http://127.0.0.1:9" if engine == "openai" else "some-target", None,
                       served_name="x")
    assert calls == [("openai", EngineOptions(api_key="k", plain_base_url=None)),
                     ("transformers", EngineOptions(dtype="float32", prefix_cache=True,
                                                    prefix_cache_mb=None)),
                     ("vllm", EngineOptions(dtype="float32"))]
    served = serve_options(build_parser().parse_args(["serve", "--engine", "vllm", "--plain-twin"]))
    assert served["vllm"].plain_twin is True and served["transformers"].plain_twin is False
    assert "openai" not in served  # the relay's options exist only with --engine openai


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(("kind", "constraint", "fields"), [
    ("vllm", OutputConstraint("json_schema", json.dumps(SCHEMA)),
     {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": SCHEMA,
                                                                 "strict": True}}}),
    ("vllm", OutputConstraint("json_object", "{}"), {"response_format": {"type": "json_object"}}),
    ("vllm", OutputConstraint("regex", "[0-9]+"), {"structured_outputs": {"regex": "[0-9]+"}}),
    ("vllm", OutputConstraint("lark", 'start: "a"'), {"structured_outputs": {"grammar": 'start: "a"'}}),
    ("sglang", OutputConstraint("regex", "[0-9]+"), {"regex": "[0-9]+"}),
])
def test_a_constraint_reaches_the_server_in_its_own_fields(kind, constraint, fields):
    with StandIn(kind) as server:
        engine = RemoteEngine(server.url)
        list(engine.stream_chat(MESSAGES, GenerationParams(max_tokens=20, constraint=constraint)))
        body = server.requests[-1]
        assert {name: body.get(name) for name in fields} == fields
        engine.close()


def test_a_constraint_kind_a_server_cannot_take_is_refused_before_it_is_sent(service):
    """The relay's engine table row names the kinds it passes on (response_format's two)."""
    import httpx

    from dflash_local.service.app import create_app
    from dflash_local.service.state import ServiceState

    relay = ServiceState()
    relay.load("openai", service[1].url + "/v1", None, served_name="relay")
    server = BackgroundServer(create_app(relay)).start()
    try:
        body = {"model": "relay", "messages": MESSAGES, "max_tokens": 8}
        refused = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                             json={**body, "structured_outputs": {"regex": "[0-9]+"}})
        assert refused.status_code == 400
        message = refused.json()["error"]["message"]
        assert message.startswith("structured_outputs:") and "not regex" in message, message
        schema = {"type": "json_schema", "json_schema": {"name": "digits", "schema": {
            "type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"],
            "additionalProperties": False}}}
        relayed = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                             json={**body, "max_tokens": 20, "response_format": schema}).json()
        assert json.loads(relayed["choices"][0]["message"]["content"])["n"] in (1, 2)
    finally:
        server.stop()
        relay.shutdown()
