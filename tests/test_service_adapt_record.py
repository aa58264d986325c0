"""Recording for adaptation through the real service on the embedded pair: a finished reply is
kept with the prompt's ids as the template made them and exactly the reply's ids; a cancelled one
is not; `adapt reset` while it serves is safe; `serve --no-adapt` records nothing; a data dir
that is read-only or full pauses recording with one log line while replies are still served."""

from __future__ import annotations

import logging

import httpx
import pytest
from client_harness import API_KEY, serve_embedded
from service_support import make_pair, start_service, wait_until
from test_service_read_only_data import disk, full, read_only  # noqa: F401 (disk: a fixture)

from dflash_local.adapt.record import ReplyRecorder
from dflash_local.adapt.store import ReplyStore, store_path
from dflash_local.cli.main import build_parser, main

TALK = [{"role": "user", "content": "Name three rivers of Europe."}]
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def embedded(tmp_path_factory, embedded_target_dir):
    with pytest.MonkeyPatch.context() as patch:  # this module's own store
        patch.setenv("DFLASH_LOCAL_HOME", str(tmp_path_factory.mktemp("adapt_home")))
        yield from serve_embedded(tmp_path_factory, embedded_target_dir)


def chat(server, **fields) -> dict:
    request = {"model": "embedded", "messages": TALK, "max_tokens": 12, "temperature": 0, **fields}
    answer = httpx.post(server.url + "/v1/chat/completions", json=request, headers=HEADERS,
                        timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()


def recorded_after(recorder: ReplyRecorder, before: int) -> None:
    """The recorder runs after the client has its reply: wait for it."""
    wait_until(lambda: recorder.recorded == before + 1)


def test_a_finished_reply_is_kept_with_its_exact_ids(embedded):
    state, server = embedded
    recorder, engine = state.loaded.recorder, state.loaded.engine
    before = recorder.recorded
    reply = chat(server)
    recorded_after(recorder, before)
    last = list(ReplyStore().replies(recorder.pair.identity))[-1]
    assert last.prompt_ids == engine.encode_chat(TALK)
    assert len(last.reply_ids) == reply["usage"]["completion_tokens"]
    text = engine.tokenizer.decode(last.reply_ids, skip_special_tokens=True)
    assert text == reply["choices"][0]["message"]["content"]
    assert last.meta["temperature"] == 0.0 and last.meta["constraint"] is None
    status = httpx.get(server.url + "/dflash/status", headers=HEADERS).json()
    assert status["loaded"]["adapt"] == {"recording": True, "recorded": before + 1,
                                         "paused": None, "pair": recorder.pair.key}


def test_a_cancelled_reply_is_not_kept(embedded):
    state, server = embedded
    recorder, worker = state.loaded.recorder, state.loaded.worker
    before, jobs = recorder.recorded, worker.jobs_done
    request = {"model": "embedded", "messages": [{"role": "user", "content": "Tell me a long story."}],
               "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=request, headers=HEADERS,
                      timeout=120) as streamed:
        next(streamed.iter_lines())  # the first chunk, then the client leaves
    wait_until(lambda: worker.jobs_done == jobs + 1)
    assert worker.last.outcome == "cancelled"
    chat(server)  # the worker records in order: once this one is kept, the cancelled one was judged
    wait_until(lambda: recorder.recorded > before)
    assert recorder.recorded == before + 1


def test_store_false_keeps_a_reply_out(embedded):
    # bench --adapt-stream's held-out prompts: served and measured, never trained on
    state, server = embedded
    recorder, worker = state.loaded.recorder, state.loaded.worker
    before, jobs = recorder.recorded, worker.jobs_done
    assert chat(server, store=False)["choices"][0]["message"]["content"]
    wait_until(lambda: worker.jobs_done == jobs + 1)
    chat(server, store=True)  # recorded in order: once this one is kept, the first was judged
    wait_until(lambda: recorder.recorded > before)
    assert recorder.recorded == before + 1
    bad = httpx.post(server.url + "/v1/chat/completions", headers=HEADERS, timeout=30,
                     json={"model": "embedded", "messages": TALK, "store": "no"})
    assert bad.status_code == 400 and "store" in bad.json()["error"]["message"]


def test_reset_while_serving_is_safe(embedded, capsys):
    state, server = embedded
    recorder = state.loaded.recorder
    before = recorder.recorded
    chat(server)
    recorded_after(recorder, before)
    assert main(["adapt", "status"]) == 0
    assert recorder.pair.key in capsys.readouterr().out
    assert main(["adapt", "reset"]) == 0
    chat(server, max_tokens=6)
    recorded_after(recorder, before + 1)
    assert [row["replies"] for row in ReplyStore().summary()] == [1]


def test_no_adapt_records_nothing(tmp_path, monkeypatch):
    from dflash_local.service import cli_serve
    from dflash_local.service import state as state_module

    class Refused(Exception):
        pass

    def capture(**options):
        raise Refused(options)

    monkeypatch.setattr(state_module, "ServiceState", capture)
    with pytest.raises(Refused) as made:  # serve's flag reaches the service's state
        cli_serve.run(build_parser().parse_args(["serve", "--no-adapt", "--no-load"]))
    assert made.value.args[0]["adapt"] is False
    monkeypatch.undo()

    monkeypatch.setenv("DFLASH_LOCAL_HOME", str(tmp_path / "home"))
    state, server = start_service(*make_pair(tmp_path / "pair"), adapt=False)
    try:
        answer = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
            "model": "tiny", "messages": TALK, "max_tokens": 4})
        assert answer.status_code == 200 and state.loaded.recorder is None
        wait_until(lambda: not state.loaded.worker.busy)
        assert state.loaded.describe()["adapt"] == {"recording": False}
    finally:
        server.stop()
    assert not store_path().exists()


@pytest.mark.parametrize("fault", [read_only, full])
def test_a_store_that_cannot_be_written_pauses_recording(embedded, disk, fault, monkeypatch,  # noqa: F811
                                                         caplog):
    state, server = embedded
    monkeypatch.setenv("DFLASH_LOCAL_HOME", str(fault(disk)))
    recorder = ReplyRecorder(state.loaded.recorder.pair)  # opens its store in the faulty dir
    monkeypatch.setattr(state.loaded.worker, "on_finished", recorder.record)
    with caplog.at_level(logging.WARNING, logger="dflash_local.adapt"):
        chat(server)  # served
        wait_until(lambda: recorder.paused)
        chat(server, max_tokens=6)  # served too, and no second line
    recorder.close()
    paused = [record for record in caplog.records if "recording replies" in record.message]
    assert len(paused) == 1 and "replies are served as before" in paused[0].message
    assert recorder.recorded == 0
