"""The service end to end: the real uvicorn server, a tiny random pair, the official openai SDK."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from service_support import make_pair, start_service, wait_until

from dflash_local.events import AUTO, Fixed

PROMPTS = ["Tell me a long story.", "Write a poem."]  # the tiny pair runs past 900 tokens on these
EOS_PROMPT = "Count slowly."  # ...and ends its turn after 7 tokens on this one


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def service(pair, tmp_path_factory):
    state, server = start_service(*pair, hub_cache_dir=tmp_path_factory.mktemp("hub"))
    yield state, server
    server.stop()


@pytest.fixture(scope="module")
def client(service):
    return openai.OpenAI(base_url=service[1].url + "/v1", api_key="unused", max_retries=0)


def messages(prompt: str) -> list[dict]:
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]


def stream_chunks(client, prompt: str, **extra) -> list:
    return list(client.chat.completions.create(
        model="tiny", messages=messages(prompt), stream=True,
        stream_options={"include_usage": True}, **extra))


def streamed_text(chunks) -> str:
    return "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)


def test_models_lists_the_loaded_pair(client):
    models = client.models.list().data
    assert [model.id for model in models] == ["tiny"]
    assert models[0].model_extra["dflash"]["drafter_block_size"] == 8
    context = client.models.list().data[0].model_extra["dflash"]["max_context"]
    assert isinstance(context, int) and context > 0  # the chat app's context meter reads it


@pytest.mark.parametrize("prompt", PROMPTS)
def test_speculative_and_plain_give_identical_greedy_output(client, prompt):
    spec = stream_chunks(client, prompt, max_tokens=24, extra_body={"speculative": True})
    plain = stream_chunks(client, prompt, max_tokens=24, extra_body={"speculative": False})
    spec_ids = [t for c in spec if c.choices for t in c.model_extra["dflash"]["token_ids"]]
    plain_ids = [t for c in plain if c.choices for t in c.model_extra["dflash"]["token_ids"]]
    assert spec_ids == plain_ids and len(spec_ids) == 24
    assert streamed_text(spec) == streamed_text(plain)
    assert spec[-1].usage.model_extra["dflash"]["block_size"] == 8
    assert plain[-1].usage.model_extra["dflash"]["block_size"] == 1
    assert {c.model_extra["dflash"]["block_size"] for c in plain if c.choices} == {1}


def test_non_streaming_matches_streaming(client):
    # one fixed width: auto's widths follow the rounds' timings, and a random tiny model's
    # near-tied logits can turn with the verify's shape (what is compared here is the reply's form)
    fixed = {"block_size": 4}
    chunks = stream_chunks(client, PROMPTS[0], max_tokens=20, extra_body=fixed)
    reply = client.chat.completions.create(model="tiny", messages=messages(PROMPTS[0]), max_tokens=20,
                                           extra_body=fixed)
    assert reply.choices[0].message.content == streamed_text(chunks)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == chunks[-1].usage.completion_tokens == 20
    assert reply.usage.prompt_tokens == chunks[-1].usage.prompt_tokens > 0


@pytest.mark.parametrize("speculative", [True, False])
def test_dflash_fields_are_consistent(client, speculative):
    chunks = stream_chunks(client, PROMPTS[1], max_tokens=30, extra_body={"speculative": speculative})
    steps = [c.model_extra["dflash"] for c in chunks if c.choices]
    usage = chunks[-1].usage
    totals = usage.model_extra["dflash"]
    assert chunks[-1].choices == [] and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert sum(len(step["token_ids"]) for step in steps) == usage.completion_tokens == 30
    assert [step["round"] for step in steps] == list(range(len(steps)))
    assert all(step["accepted"] <= step["drafted"] and step["accepted"] < len(step["token_ids"]) + 1
               for step in steps)
    assert totals["drafted"] == sum(step["drafted"] for step in steps)
    assert totals["accepted"] == sum(step["accepted"] for step in steps)
    histogram = totals["accepted_per_round"]
    assert sum(histogram) == totals["rounds"] == len(steps) - 1
    assert 1 + sum(k * rounds for k, rounds in enumerate(histogram)) == usage.completion_tokens
    assert totals["tau"] == pytest.approx((usage.completion_tokens - 1) / totals["rounds"], abs=1e-3)
    assert totals["engine"] == "transformers" and totals["speculative"] is speculative
    assert totals["decode_tokens_per_s"] > 0 and totals["prefill_tokens_per_s"] > 0
    assert (totals["drafted"] > 0) is speculative
    assert all(step["accepted"] <= step["draft_depth"] <= step["drafted"] for step in steps)
    assert all(0 <= step["copied"] <= step["accepted"] and 0 <= step["copied_chars"] <= step["accepted_chars"]
               for step in steps)


@pytest.mark.parametrize("tree", [True, False])
def test_tree_field_switches_tree_drafts(client, tree):
    chunks = stream_chunks(client, PROMPTS[1], max_tokens=30,
                           extra_body={"tree": tree, "block_size": 8})
    steps = [c.model_extra["dflash"] for c in chunks if c.choices][1:]
    full = [step for step in steps if step["block_size"] == 8]
    assert full and all(step["drafted"] == 7 for step in full)
    # the tiny random drafter is unsure everywhere: its 7 best paths spread, never one 7-deep chain
    assert all((step["draft_depth"] < 7) is tree for step in full)
    totals = chunks[-1].usage.model_extra["dflash"]
    assert totals["draft_depth"] == sum(step["draft_depth"] for step in steps)
    assert (totals["draft_depth"] < totals["drafted"]) is tree


@pytest.mark.parametrize("speculative", [True, False])
def test_end_of_turn_token_finishes_with_stop(client, speculative):
    chunks = stream_chunks(client, EOS_PROMPT, max_tokens=50, extra_body={"speculative": speculative})
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    assert chunks[-1].usage.completion_tokens < 50
    reply = client.chat.completions.create(model="tiny", messages=messages(EOS_PROMPT), max_tokens=50)
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == streamed_text(chunks)


def test_usage_only_when_asked(client):
    chunks = list(client.chat.completions.create(model="tiny", messages=messages("Hi"), max_tokens=4,
                                                 stream=True))
    assert all(chunk.usage is None and chunk.choices for chunk in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_truncates_text(client):
    full = client.chat.completions.create(model="tiny", messages=messages(PROMPTS[0]), max_tokens=40)
    text = full.choices[0].message.content
    start = next(i for i in range(4, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    stop = text[start:start + 2]
    expected = text[: text.find(stop)]
    reply = client.chat.completions.create(model="tiny", messages=messages(PROMPTS[0]),
                                           max_tokens=40, stop=[stop, "never-there"])
    assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == (expected, "stop")
    chunks = stream_chunks(client, PROMPTS[0], max_tokens=40, stop=stop)
    assert streamed_text(chunks) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_seeded_sampling_repeats(client):
    def sample(seed):
        return client.chat.completions.create(
            model="tiny", messages=messages("Hi"), max_tokens=16, temperature=0.9, top_p=0.9,
            seed=seed).choices[0].message.content
    assert sample(7) == sample(7)


@pytest.mark.parametrize("extra", [
    {"chat_template_kwargs": {"enable_thinking": False}},
    {"thinking": True},
    {"block_size": 4},
    {"model": "default"},
    {"model": "tiny-target"},
])
def test_accepted_options(service, extra):
    body = {"model": "tiny", "messages": messages("Hi"), "max_tokens": 6, **extra}
    reply = httpx.post(service[1].url + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    if "block_size" in extra:
        dflash = reply.json()["usage"]["dflash"]
        assert (dflash["block_size"], dflash["block_policy"]) == (4, "fixed")


def test_auto_block_size_is_lossless_and_says_so(service):
    """block_size "auto": the calibrated policy picks each round's width (plain rounds included);
    the reply equals plain decoding's, and every round stays within the drafter's B."""
    def reply(**extra):
        body = {"model": "tiny", "messages": messages(PROMPTS[0]), "max_tokens": 24, **extra}
        response = httpx.post(service[1].url + "/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()

    auto, plain = reply(block_size="auto"), reply(speculative=False)
    assert auto["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    dflash = auto["usage"]["dflash"]
    assert (dflash["block_policy"], dflash["block_size"]) == ("auto", 8)
    assert dflash["accepted"] <= dflash["drafted"] <= 7 * dflash["rounds"]


def test_disconnect_stops_generation_within_one_round(service):
    state, server = service
    body = {"messages": messages(PROMPTS[1]), "max_tokens": 900, "stream": True,
            "speculative": False}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            data = (line for line in response.iter_lines() if line.startswith("data: "))
            first = [json.loads(next(data)[6:]) for _ in range(3)]
        job_id = first[0]["id"]
        # the connection is closed here; the worker must notice at its next round

        def job_finished():
            worker = http.get(server.url + "/dflash/status").json()["worker"]
            last = worker["last"]
            return last if last and last["id"] == job_id and worker["current"] is None else None

        last = wait_until(job_finished, timeout=60)
    assert last["outcome"] == "cancelled"
    assert last["rounds_at_cancel"] is not None
    assert last["rounds"] - last["rounds_at_cancel"] <= 1
    assert last["rounds"] < 899
    assert state.loaded.worker.current is None


def test_concurrent_clients_all_answered(service):
    url = service[1].url

    def one(index: int):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        try:
            if index % 2:
                chunks = stream_chunks(client, PROMPTS[index % 2], max_tokens=12)
                return 200, chunks[-1].usage.completion_tokens
            reply = client.chat.completions.create(model="tiny", messages=messages("Hi"), max_tokens=12)
            return 200, reply.usage.completion_tokens
        except openai.RateLimitError as exc:
            return 429, exc.body["code"]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    assert {status for status, _ in results} <= {200, 429}
    assert all(detail == 12 for status, detail in results if status == 200)
    assert all(detail == "queue_full" for status, detail in results if status == 429)
    assert httpx.get(url + "/health").json()["status"] == "ok"
    wait_until(lambda: not httpx.get(url + "/dflash/status").json()["worker"]["busy"])


def test_full_queue_answers_429(pair):
    """One generation at a time (--max-batch 1): a second request waits, a third is refused."""
    _state, server = start_service(*pair, max_queue=1, max_batch=1)
    long_body = {"messages": messages(PROMPTS[0]), "max_tokens": 900, "stream": True,
                 "speculative": False}
    try:
        with httpx.Client(timeout=60) as http, ThreadPoolExecutor(1) as pool:
            status_url = server.url + "/dflash/status"
            with http.stream("POST", server.url + "/v1/chat/completions", json=long_body) as running:
                lines = running.iter_lines()  # kept referenced: closing it would drop the connection
                assert next(lines).startswith("data: ")
                queued = pool.submit(httpx.post, server.url + "/v1/chat/completions", timeout=60,
                                     json={"messages": messages("Hi"), "max_tokens": 3})
                wait_until(lambda: http.get(status_url).json()["worker"]["queued"] == 1)
                refused = http.post(server.url + "/v1/chat/completions",
                                    json={"messages": messages("Hi"), "max_tokens": 3})
            assert refused.status_code == 429
            assert refused.json()["error"]["type"] == "rate_limit_error"
            assert refused.headers["retry-after"] == "1"
            assert queued.result().status_code == 200  # ran once the stream was dropped
    finally:
        server.stop()


def test_disconnect_without_streaming_cancels_too(service):
    body = {"messages": messages(PROMPTS[0]), "max_tokens": 900, "speculative": False}
    url = service[1].url
    jobs_before = httpx.get(url + "/dflash/status").json()["worker"]["jobs_done"]
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=0.1))

    def our_job_done():
        worker = httpx.get(url + "/dflash/status").json()["worker"]
        done = worker["current"] is None and worker["jobs_done"] > jobs_before
        return worker["last"] if done else None

    last = wait_until(our_job_done, timeout=60)
    assert last["outcome"] == "cancelled" and last["rounds"] - last["rounds_at_cancel"] <= 1


def test_prompt_lookup_can_be_switched_off_per_request(service, client):
    """With block_size "auto" a round may verify a prompt-lookup draft (mode "lookup" on its
    chunk); prompt_lookup false keeps every round the drafter's or plain. Same text both ways."""
    def modes_and_text(**extra):
        chunks = stream_chunks(client, PROMPTS[0], max_tokens=80, extra_body={"block_size": "auto", **extra})
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return {c.model_extra["dflash"]["mode"] for c in chunks if c.choices}, text

    with_lookup, text = modes_and_text()
    without, text_without = modes_and_text(prompt_lookup=False)
    assert "lookup" in with_lookup  # the tiny pair's story repeats itself: copying pays
    assert "lookup" not in without and text_without == text


# --- calibration at load: the first chat with block size auto does not wait for it ---

@pytest.fixture
def empty_service(tmp_path, monkeypatch):
    """A served ServiceState with nothing loaded, in its own data dir; its phases recorded with
    what /dflash/status said at that moment."""
    from service_support import torch_loader

    from dflash_local.service.app import create_app
    from dflash_local.service.server import BackgroundServer
    from dflash_local.service.state import ServiceState

    monkeypatch.setenv("DFLASH_LOCAL_HOME", str(tmp_path / "home"))
    seen = []

    def on_phase(name: str, phase: str) -> None:
        status = httpx.get(server.url + "/dflash/status", timeout=10).json()
        seen.append((name, phase, status["loading"], status["loading_phase"]))

    state = ServiceState(loader=torch_loader, on_loading_phase=on_phase)
    server = BackgroundServer(create_app(state)).start()
    yield state, server, seen
    server.stop()
    state.shutdown()


def test_a_load_with_block_size_auto_calibrates_before_the_first_chat(pair, empty_service,
                                                                     monkeypatch):
    from dflash_local.method import calibration

    state, server, seen = empty_service
    state.load("transformers", *pair, served_name="tiny", block_size=AUTO)
    assert seen == [("tiny", "calibrating", "tiny", "calibrating")]  # shown while it measured
    status = httpx.get(server.url + "/dflash/status", timeout=10).json()
    assert status["loaded"]["default_block_size"] == "auto" and status["loading_phase"] is None
    assert status["calibration"]["measured_at"] and "reliable" in status["calibration"]
    verify = status["calibration"]["batch"]["verify"]  # the lanes' batched verify, fitted
    assert verify["fixed_s"] > 0 and min(verify["lane_s"], verify["row_s"]) >= 0
    assert len(list(calibration.paths.data_dir().glob("calibration/*.json"))) == 1

    def measured_again(*_args, **_kwargs):
        raise AssertionError("measured again")

    real_measure = calibration.measure
    monkeypatch.setattr(calibration, "measure", measured_again)
    reply = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": messages(EOS_PROMPT), "max_tokens": 8})
    assert reply.status_code == 200, reply.text
    wait_until(lambda: not state.loaded.worker.busy)  # the reply can arrive before it is idle
    # a new load of the same pair reads the cache; a fixed block size needs none
    for block_size in (AUTO, Fixed(4)):
        state.load("transformers", *pair, served_name="tiny", block_size=block_size)
    assert len(seen) == 1
    monkeypatch.setattr(calibration, "measure", real_measure)  # again when asked (disturbed)
    state.load("transformers", *pair, served_name="tiny", block_size=AUTO, recalibrate=True)
    assert [phase for _, phase, _, _ in seen] == ["calibrating", "calibrating"]


def test_a_calibration_that_cannot_be_cached_still_loads(pair, empty_service, caplog):
    from dflash_local.method import calibration

    state, _server, seen = empty_service
    (calibration.paths.data_dir() / "calibration").write_text("a file where the cache goes")
    state.load("transformers", *pair, served_name="tiny", block_size=AUTO)
    assert state.loaded is not None and state.loaded.engine.calibration is not None
    assert [phase for _, phase, _, _ in seen] == ["calibrating"]
    assert "could not be cached" in caplog.text and "measures again" in caplog.text


def test_a_calibration_that_fails_fails_the_load_and_frees_the_engine(pair, empty_service,
                                                                      monkeypatch):
    from dflash_local.engines.torch_engine import TorchEngine
    from dflash_local.method import calibration
    from dflash_local.service.api_errors import LoadFailedError

    state, server, _seen = empty_service
    closed = []
    monkeypatch.setattr(TorchEngine, "close", lambda engine: closed.append(engine))

    def interrupted(*_args, **_kwargs):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(calibration, "measure", interrupted)
    with pytest.raises(LoadFailedError, match="RuntimeError: interrupted"):
        state.load("transformers", *pair, served_name="tiny", block_size=AUTO)
    status = httpx.get(server.url + "/dflash/status", timeout=10).json()
    assert status["loaded"] is None and status["loading"] is None
    assert status["load_error"] == "RuntimeError: interrupted" and len(closed) == 1
