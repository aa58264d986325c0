"""`bench --adapt-stream`: its kinds of use (ShareGPT read to its cut, the reserved bucket left
out, stream and held-out sets disjoint by conversation, the agent kind's sessions), its
measurement against the real service on the embedded pair (held-out prompts and probes never
recorded, speculative identical to plain, a service without adaptation said so), the wait for
adaptation to catch up, the record it writes, and its refusals."""

from __future__ import annotations

import json

import pytest
from client_harness import API_KEY, serve_embedded
from service_support import wait_until

from dflash_local.bench import adapt_kinds, adapt_stream
from dflash_local.bench.adapt_kinds import (
    AdaptPrompt,
    KindSet,
    agent_kind,
    as_text,
    read_sharegpt,
    reserved,
    sharegpt_kinds,
)
from dflash_local.bench.adapt_report import ABSENT, write_record
from dflash_local.bench.adapt_service import ServiceClient
from dflash_local.bench.adapt_stream import Probes, StreamSettings, catch_up, measure_kind
from dflash_local.cli.main import build_parser, main

TEXTS = {"coding": "Write a python function that parses a date string.",
         "general": "How should I plan a week of walking in the hills?",
         "language": "주말에 가족과 함께 갈 만한 조용한 산책길을 추천해 주세요."}


def conversation(conversation_id: str, kind: str, turns: int = 1) -> dict:
    talk = []
    for index in range(turns):
        talk += [{"from": "human", "value": f"{TEXTS[kind]} ({index})"},
                 {"from": "gpt", "value": "..."}]
    return {"id": conversation_id, "conversations": talk}


def sharegpt_file(tmp_path, conversations: list[dict], cut: int = 0):
    """A ShareGPT-shaped JSON list, cut `cut` characters before its end as the package's is."""
    text = json.dumps(conversations, indent=2)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[:len(text) - cut] if cut else text, encoding="utf-8")
    return path


def ids_per_bucket(reserved_wanted: bool, count: int, prefix: str) -> list[str]:
    found, index = [], 0
    while len(found) < count:
        candidate = f"{prefix}{index}"
        if reserved(candidate) == reserved_wanted:
            found.append(candidate)
        index += 1
    return found


def test_the_reserved_bucket_is_one_in_sixteen_by_sha256():
    ids = [f"conv{i}" for i in range(1600)]
    share = sum(reserved(i) for i in ids) / len(ids)
    assert 0.04 < share < 0.09  # 1/16 = 0.0625, for sha256 spreading ids evenly
    import hashlib
    assert all(reserved(i) == (int(hashlib.sha256(i.encode()).hexdigest(), 16) % 16 == 7)
               for i in ids[:50])


def test_a_cut_file_is_read_to_its_last_whole_record(tmp_path):
    records = [conversation(f"c{i}", "general") for i in range(5)]
    path = sharegpt_file(tmp_path, records, cut=40)  # the last record loses its end
    assert [cid for cid, _ in read_sharegpt(path)] == ["c0", "c1", "c2", "c3"]
    whole = sharegpt_file(tmp_path, records)
    assert [cid for cid, _ in read_sharegpt(whole)] == [f"c{i}" for i in range(5)]


def test_kinds_leave_out_the_reserved_bucket_and_split_by_conversation(tmp_path):
    kept = {kind: ids_per_bucket(False, 6, kind) for kind in TEXTS}
    banned = {kind: ids_per_bucket(True, 3, kind) for kind in TEXTS}
    records = [conversation(cid, kind, turns=3 if kind == "language" else 1)
               for kind in TEXTS for cid in banned[kind] + kept[kind]]
    sets = sharegpt_kinds(tuple(TEXTS), stream_size=4, held_out_size=2,
                          path=sharegpt_file(tmp_path, records))
    for kind, kind_set in sets.items():
        used = {p.prompt_id.split("/")[1] for p in kind_set.stream + kind_set.held_out}
        assert not used & set(banned[kind]), kind  # judging only
        assert used <= set(kept[kind])
        held = {p.prompt_id.split("/")[1] for p in kind_set.held_out}
        streamed = {p.prompt_id.split("/")[1] for p in kind_set.stream}
        assert not held & streamed  # a conversation wholly on one side
        assert len(kind_set.held_out) == 2 and len(kind_set.stream) == 4
        assert all(TEXTS[kind] in p.messages[0]["content"] for p in kind_set.stream)
    # language takes every turn of its conversations: 2 held out fill one conversation's 3 turns
    assert len({p.prompt_id.split("/")[1] for p in sets["language"].held_out}) == 1
    held_only = sharegpt_kinds(tuple(TEXTS), stream_size=0, held_out_size=3,
                               path=sharegpt_file(tmp_path, records))  # the 0 checkpoint alone
    assert all(len(s.held_out) == 3 and not s.stream for s in held_only.values())


def test_too_few_prompts_of_a_kind_is_said(tmp_path):
    path = sharegpt_file(tmp_path, [conversation(c, "coding") for c in ids_per_bucket(False, 2, "x")])
    with pytest.raises(adapt_kinds.DatasetUnavailableError, match="kind coding: 2 held-out"):
        sharegpt_kinds(("coding",), stream_size=5, held_out_size=3, path=path)


def test_the_agent_kind_is_an_agents_session_on_real_source():
    kind_set = agent_kind(stream_size=12, held_out_size=4)
    stream_modules = {p.prompt_id.split("/")[1].rsplit(".", 1)[0] for p in kind_set.stream}
    held_modules = {p.prompt_id.split("/")[1].rsplit(".", 1)[0] for p in kind_set.held_out}
    assert not stream_modules & held_modules
    first = kind_set.stream[0]
    roles = [m["role"] for m in first.messages]
    assert roles == ["system", "user", "assistant", "tool"] and first.tools
    assert first.messages[3]["content"].lstrip().startswith("def ")  # the function's own source
    text = first.as_text()
    assert not text.tools and [m["role"] for m in text.messages] == ["system", "user",
                                                                      "assistant", "user"]
    assert "read_file" in text.messages[0]["content"] and "Tool result" in text.messages[3]["content"]


# --- against the real service (the embedded pair, in process) ---

@pytest.fixture(scope="module")
def embedded(tmp_path_factory, embedded_target_dir):
    with pytest.MonkeyPatch.context() as patch:  # this module's own recorded replies
        patch.setenv("DFLASH_LOCAL_HOME", str(tmp_path_factory.mktemp("adapt_stream_home")))
        yield from serve_embedded(tmp_path_factory, embedded_target_dir)


def tiny_kind(kind: str, count: int, held_out: int) -> KindSet:
    prompts = [AdaptPrompt(f"{kind}/{i}", ({"role": "user", "content": f"{text} {i}"},))
               for i, text in enumerate(["Name a river.", "Count to five.", "Say a colour.",
                                         "Name a tree.", "Spell cat."][:count + held_out])]
    return KindSet(kind, "written for this test", tuple(prompts[:count]), tuple(prompts[count:]))


def test_a_kind_is_measured_with_only_its_stream_recorded(embedded, tmp_path):
    state, server = embedded
    recorder = state.loaded.recorder
    client = ServiceClient(server.url, API_KEY)
    settings = StreamSettings(checkpoints=(0, 2, 9), max_tokens=8, ttft_arrivals=1)
    before = recorder.recorded
    try:
        kind_set = as_text(tiny_kind("agent", 2, 1))
        result = measure_kind(client, kind_set, tiny_kind("general", 0, 1).held_out, settings)
    finally:
        client.close()
    wait_until(lambda: recorder.recorded >= before + 2)
    assert recorder.recorded == before + 2  # the stream's; held-out replies and probes: store false
    assert result["adaptation"] is False  # this service records but does not train
    first, second, missing = result["points"]
    assert (first["replies"], second["replies"]) == (0, 2) and "missing" in missing
    for point in (first, second):
        assert point["identical"] and point["tau"] >= 1.0 and point["speedup"] > 0
        assert point["versions"] == [None] and point["general_tau"] >= 1.0
        assert point["caught_up_s"] is None
    assert result["ttft"]["during_training"] == [] and len(result["ttft"]["idle"]) == 1
    args = build_parser().parse_args(["bench", "--adapt-stream", "agent", "--adapt-checkpoints",
                                      "0,2,9", "--out", str(tmp_path)])
    record = json.loads(write_record([result], args).read_text(encoding="utf-8"))
    assert record["settings"]["checkpoints"] == "0, 2, 9" and record["results"] == [result]
    assert record["notes"][0] == ABSENT and "no probe arrived" in record["notes"][1]
    rows = record["rows"]
    assert rows[0]["tau_gain"] == 1.0 and rows[1]["tau"] == second["tau"]
    assert rows[2]["tau"].startswith("not reached")


class ScriptedService:
    """The adapt status a trainer reports (not on this branch yet): training, then caught up."""

    def __init__(self, statuses: list[dict]):
        self.statuses = statuses
        self.probes = 0

    def status(self) -> dict:
        return {"adapt": self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]}

    def reply(self, fields, *, speculative, max_tokens, store):
        assert store is False  # a probe is never trained on
        self.probes += 1
        return adapt_stream.Reply(0.05, 1.0, 10.0, 1, 1, (1,))


def test_catch_up_probes_while_training_and_ends_when_nothing_is_pending(monkeypatch):
    monkeypatch.setattr(adapt_stream, "POLL_S", 0.0)
    service = ScriptedService([{"pending": 3, "training": True}] * 3
                              + [{"pending": 0, "training": True},
                                 {"pending": 0, "training": False}])
    probes = Probes()
    catch_up(service, probes, StreamSettings(ttft_arrivals=2))
    assert service.probes == 2 and probes.during_training == [0.05, 0.05]
    assert adapt_stream.adaptation_present({"adapt": {"enabled": True, "pending": 0, "training": False}})
    assert not adapt_stream.adaptation_present({"adapt": {"enabled": False, "pending": 0,
                                                          "training": False}})
    assert not adapt_stream.adaptation_present({"adapt": {"recording": True}})


def test_bad_flags_are_refused_before_any_service_starts(capsys):
    assert main(["bench", "--adapt-stream", "coding,poetry", "--sharegpt-file", "/nowhere"]) != 0
    assert "unknown kind poetry" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--adapt-stream", "--adapt-checkpoints", "50,25"])
    assert "increasing" in capsys.readouterr().err
    assert main(["bench", "--adapt-stream", "agent", "--engine", "openai",
                 "--base-url", "http://127.0.0.1:9"]) != 0
    assert "starts a service of its own" in capsys.readouterr().err
