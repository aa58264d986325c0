"""dflash-chat's plain parts: storage, settings, stats, the action table, and its boundaries."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib

import pytest
from dflash_chat.actions import ACTIONS, check_keymap
from dflash_chat.chat_text import export_markdown
from dflash_chat.protocol import StreamChunk
from dflash_chat.settings import Settings, dumps, load_settings, save_settings
from dflash_chat.stats import LiveStats, race_verdict
from dflash_chat.storage import ChatStore
from dflash_chat.widgets.speed_panel import figures_text


def chunk(ids, accepted=0, round_index=1, at=0.0, text="x") -> StreamChunk:
    return StreamChunk(text, tuple(ids), drafted=7 if round_index else 0, accepted=accepted,
                       round=round_index, block_size=8, received_at=at)


# --- storage ---

def test_messages_round_trip_and_regenerate_drops_the_tail(tmp_path):
    store = ChatStore(tmp_path / "chats.db")
    chat = store.create_chat("First", "Be brief.")
    user = store.add_message(chat.id, "user", "hi")
    reply = store.add_message(chat.id, "assistant", "", "streaming", {"speculative": True})
    store.update_message(reply.id, "hello", "done", {"speculative": True, "stats": {"tau": 2.5}})
    assert [(m.role, m.content, m.status) for m in store.messages(chat.id)] == [
        ("user", "hi", "done"), ("assistant", "hello", "done")]
    assert store.message(reply.id).meta["stats"]["tau"] == 2.5
    store.delete_messages_from(chat.id, reply.id)
    assert [m.id for m in store.messages(chat.id)] == [user.id]
    markdown = export_markdown(store.chat(chat.id), store.messages(chat.id))
    assert markdown.startswith("# First") and "> System: Be brief." in markdown and "hi" in markdown
    store.delete_chat(chat.id)
    assert store.chats() == [] and store.messages(chat.id) == []


def test_prompt_history_is_oldest_first_without_repeats(tmp_path):
    store = ChatStore(tmp_path / "chats.db")
    chat = store.create_chat("c")
    for prompt in ("a", "b", "b", "c"):
        store.add_message(chat.id, "user", prompt)
    assert store.prompt_history() == ["a", "b", "c"]


KILLED_WRITER = """
import os, sys
from dflash_chat.storage import ChatStore
store = ChatStore(sys.argv[1])
chat = store.create_chat("killed")
reply = store.add_message(chat.id, "assistant", "", "streaming")
store.update_message(reply.id, "partial text already shown", "streaming")
os._exit(9)  # no close, no commit beyond what each write did
"""


def test_a_killed_writer_loses_nothing_already_written(tmp_path):
    path = tmp_path / "chats.db"
    subprocess.run([sys.executable, "-c", KILLED_WRITER, str(path)], check=False)
    store = ChatStore(path)  # opening marks the reply the crash left streaming
    (chat,) = store.chats()
    (message,) = store.messages(chat.id)
    assert (message.content, message.status) == ("partial text already shown", "interrupted")


# --- settings ---

def test_settings_round_trip_through_toml(tmp_path):
    tricky = 'say "hi"\\ then\nnew line\ttab \x01 \x7f é 🦊'
    settings = Settings(theme="textual-light", speculative=False, temperature=0.7, seed=3,
                        system_prompt=tricky, keymap={"race": "f12", "help": "ctrl+h,f1"})
    path = tmp_path / "settings.toml"
    save_settings(settings, path)
    assert tomllib.loads(path.read_text())["system_prompt"] == tricky
    assert load_settings(path) == (settings, [])


def test_bad_settings_fall_back_and_say_why(tmp_path):
    path = tmp_path / "settings.toml"
    path.write_text('temperature = "hot"\nmax_tokens = 64\n')
    settings, problems = load_settings(path)
    assert settings.max_tokens == 64 and settings.temperature == 0.0
    assert "temperature = 'hot'" in problems[0]
    path.write_text("top_p = 5.0\n")
    settings, problems = load_settings(path)
    assert settings == Settings() and "top_p 5.0" in problems[0]
    path.write_text("draft_window = -5\n")
    settings, problems = load_settings(path)
    assert settings == Settings() and "draft_window -5 is not >= 0" in problems[0]
    path.write_text("this is not toml")
    assert load_settings(path)[0] == Settings()


def test_keymap_conflicts_are_reported():
    assert check_keymap({}) == []
    assert check_keymap({"race": "f2"}) == [
        "key 'f2' is bound to both 'toggle_speculative' and 'race'"]
    assert "unknown action 'fly'" in check_keymap({"fly": "f12"})[0]
    assert len({spec.id for spec in ACTIONS}) == len(ACTIONS)


def test_sampling_options_follow_the_settings():
    assert Settings().sampling() == {"temperature": 0.0, "top_p": 1.0, "max_tokens": 512}
    options = Settings(seed=7, block_size=4, thinking="off", draft_window=512).sampling()
    assert (options["seed"], options["block_size"], options["thinking"]) == (7, 4, False)
    assert options["draft_window"] == 512  # 0, the default, leaves it to the service
    assert "[keymap]" in dumps(Settings())


# --- stats ---

def test_live_stats_count_rounds_like_the_service():
    stats = LiveStats(speculative=True)
    stats.add(chunk([1], round_index=0, at=0.5))  # the prefill's token
    stats.add(chunk([2, 3, 4], accepted=2, at=0.6))
    stats.add(chunk([5], accepted=0, at=0.7))
    snap = stats.snapshot()
    assert (snap.tokens, snap.rounds, snap.tau) == (5, 2, 2.0)
    assert (snap.drafted, snap.accepted) == (14, 2)
    assert snap.per_round == ((1, 1), (3, 1)) and snap.prefill_s is None  # the service's, at the end
    assert snap.tokens_per_s_now == pytest.approx(20.0)  # 4 tokens after the first in 0.2 s
    for step in range(1, 9):  # then 2 tokens every 0.25 s: 8 tokens in the last second
        stats.add(chunk([6, 7], accepted=1, at=0.7 + 0.25 * step))
    assert stats.snapshot().tokens_per_s_now == pytest.approx(8.0)
    stats.finish({"tau": 2.0, "decode_tokens_per_s": 40.0, "accepted_per_round": [0, 1, 0, 1],
                  "speculative": True, "drafted": 14, "accepted": 2, "rounds": 2})
    final = stats.snapshot()
    assert final.final and final.tokens_per_s == 40.0 and final.per_round == ((1, 1), (3, 1))
    assert final.tokens_per_s_now == 0.0  # the stream is over
    assert not final.cached_tokens and "cached" not in str(figures_text(final))


def test_the_speed_panel_says_how_much_of_the_prompt_came_from_cache():
    stats = LiveStats(speculative=True)
    stats.add(chunk([1], round_index=0, at=0.5))
    stats.finish({"prefill_s": 0.012, "prefill_tokens": 40, "cached_tokens": 920, "rounds": 0})
    snap = stats.snapshot()
    assert (snap.prompt_tokens, snap.cached_tokens) == (960, 920)
    text = str(figures_text(snap))
    assert "12 ms prefill" in text and "920/960 prompt tokens cached" in text


def test_race_verdict_compares_token_for_token():
    same = race_verdict([1, 2, 3], [1, 2, 3], {"decode_tokens_per_s": 10.0},
                        {"decode_tokens_per_s": 25.0, "tau": 3.0})
    assert same.identical and same.speedup == 2.5 and "identical" in same.summary()
    differ = race_verdict([1, 2, 3], [1, 9, 3], {}, {})
    assert not differ.identical and differ.first_difference == 1
    shorter = race_verdict([1, 2, 3], [1, 2], {}, {})
    assert not shorter.identical and shorter.first_difference == 2
    # a difference in half precision says why; in float32 it is a bug, and says nothing more
    assert "round differently" not in race_verdict([1, 2], [1, 9], {}, {}, "float32").summary()
    half = race_verdict([1, 2], [1, 9], {}, {}, "bfloat16").summary()
    assert "in bfloat16 a verify pass and a plain step round differently" in half
    assert "round differently" not in race_verdict([1, 2], [1, 2], {}, {}, "bfloat16").summary()
    assert "round differently" not in race_verdict([1, 2], [1, 9], {}, {}, "server").summary()


def test_accepted_tokens_are_coloured_per_round():
    from dflash_chat.widgets.draft_colours import DRAFT_STYLE, accepted_text

    text = accepted_text("abcdXY", [[4, 3, 4], [2, 0, 1]])
    assert text.plain == "abcdXY"
    green = [text.plain[s.start:s.end] for s in text.spans if str(s.style) == DRAFT_STYLE]
    assert green == ["abc"]


# --- boundaries ---

PLAIN_MODULES = ["storage", "settings", "client", "service", "stats", "actions", "attachments",
                 "editor"]


@pytest.mark.parametrize("module", PLAIN_MODULES)
def test_plain_modules_do_not_import_textual(module):
    code = (f"import sys, dflash_chat.{module}; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'textual'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.replace("'", '"')) == []


def test_the_app_imports_no_model_code():
    heavy = {"torch", "mlx", "mlx_lm", "transformers", "fastapi", "uvicorn", "huggingface_hub",
             "httpx"}  # httpx: loaded by the connect worker, after the first paint
    code = ("import sys, dflash_chat.app, dflash_chat.screens.race, dflash_chat.screens.picker, "
            "dflash_chat.screens.settings, dflash_chat.screens.help; "
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {heavy!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.replace("'", '"')) == []
    only_app = ("import sys, dflash_chat.app; "
                "print(sorted(m for m in sys.modules if m.startswith('dflash_local')))")
    imported = subprocess.run([sys.executable, "-c", only_app], capture_output=True, text=True,
                              check=True).stdout
    assert json.loads(imported.replace("'", '"')) == []  # paths is imported when the app starts


def test_exact_accepted_characters_win_over_the_estimate():
    from dflash_chat.widgets.draft_colours import DRAFT_STYLE, accepted_text

    # a round of 3 committed tokens, 2 of them drafted, whose drafts made 5 of its 6 characters
    text = accepted_text("HelloX", [[6, 2, 3, 5]])
    green = [text.plain[s.start:s.end] for s in text.spans if str(s.style) == DRAFT_STYLE]
    assert green == ["Hello"]


def test_copied_drafts_are_coloured_apart_from_the_drafters():
    from dflash_chat.widgets.draft_colours import DRAFT_STYLE, LOOKUP_STYLE, accepted_text

    # round 1: the drafter's accepted tokens made "He", a grafted copy's "llo", the bonus "X";
    # round 2 (an older record: no copy count): its accepted draft "a", the bonus "b"
    text = accepted_text("HelloXab", [[6, 4, 5, 5, 3], [2, 1, 2, 1]])
    assert text.plain == "HelloXab"
    spans = [(str(s.style), text.plain[s.start:s.end]) for s in text.spans if s.end > s.start]
    assert spans == [(DRAFT_STYLE, "He"), (LOOKUP_STYLE, "llo"), (DRAFT_STYLE, "a")]
    # a stop string cut the round after "Hel": the drafter's "He" stays green, not the copy's colour
    cut = accepted_text("Hel", [[3, 4, 5, 5, 3]])
    assert [(str(s.style), cut.plain[s.start:s.end]) for s in cut.spans] == [
        (DRAFT_STYLE, "He"), (LOOKUP_STYLE, "l")]
    unsaid = accepted_text("Hel", [[3, 2, 3, 2, None]])  # a service that sends no copy count
    assert [(str(s.style), unsaid.plain[s.start:s.end]) for s in unsaid.spans if s.end > s.start] == [
        (DRAFT_STYLE, "He")]


def test_the_client_reads_the_copy_counts_of_a_chunk():
    from dflash_chat.client import _chunk

    chunk = _chunk({"delta": {"content": "Hello"}}, {"token_ids": [1, 2, 3], "accepted": 2, "copied": 1,
                                                     "accepted_chars": 4, "copied_chars": 2, "mode": "speculative"})
    assert (chunk.accepted, chunk.accepted_chars, chunk.copied_chars) == (2, 4, 2)


def test_plain_fallback_rounds_are_counted_and_shown():
    from dflash_chat.protocol import StreamChunk
    from dflash_chat.stats import LiveStats
    from dflash_chat.widgets.speed_panel import speculation_text

    stats = LiveStats(speculative=True)
    stats.add(StreamChunk("a", token_ids=(1,), round=0))
    stats.add(StreamChunk("bc", token_ids=(2, 3), drafted=3, accepted=1, round=1, block_size=4))
    stats.add(StreamChunk("d", token_ids=(4,), round=2, block_size=1, mode="plain-fallback"))
    snap = stats.snapshot()
    assert (snap.plain_rounds, snap.rounds, snap.mode) == (1, 2, "plain-fallback")
    assert "plain fallback 1/2 rounds" in speculation_text(snap).plain


def test_tree_rounds_count_acceptance_out_of_the_reachable_drafts():
    from dflash_chat.protocol import StreamChunk
    from dflash_chat.stats import LiveStats
    from dflash_chat.widgets.speed_panel import speculation_text

    stats = LiveStats(speculative=True)
    stats.add(StreamChunk("a", token_ids=(1,), round=0))
    # a tree of 15 nodes whose longest path is 6 deep kept 3; a chain of 7 (no draft_depth sent) kept 1
    stats.add(StreamChunk("bcde", token_ids=(2, 3, 4, 5), drafted=15, draft_depth=6, accepted=3, round=1,
                          block_size=16))
    stats.add(StreamChunk("fg", token_ids=(6, 7), drafted=7, accepted=1, round=2, block_size=8))
    snap = stats.snapshot()
    assert (snap.drafted, snap.reachable, snap.accepted) == (22, 13, 4)
    assert snap.acceptance == pytest.approx(4 / 13)
    shown = speculation_text(snap).plain
    assert "accepted 4/13 drafted (31%)" in shown and "22 tree nodes verified" in shown
    from dflash_chat.widgets.race_lane import lane_figures

    assert "accepted 4/13" in lane_figures(snap)  # the race lanes count the same way
    stats.finish({"drafted": 22, "draft_depth": 13, "accepted": 4, "rounds": 2})
    assert stats.snapshot().acceptance == pytest.approx(4 / 13)  # the service's totals, same rule
    stats.finish({"drafted": 7, "accepted": 1, "rounds": 1})  # a service that sends no depth
    chains = stats.snapshot()
    assert chains.reachable == 7 and "tree nodes" not in speculation_text(chains).plain


def test_prompt_lookup_rounds_are_counted_and_shown_apart_from_fallback():
    from dflash_chat.protocol import StreamChunk
    from dflash_chat.stats import LiveStats
    from dflash_chat.widgets.speed_panel import speculation_text

    stats = LiveStats(speculative=True)
    stats.add(StreamChunk("a", token_ids=(1,), round=0))
    stats.add(StreamChunk("bcd", token_ids=(2, 3, 4), drafted=5, accepted=2, round=1, block_size=6,
                          mode="lookup"))
    stats.add(StreamChunk("e", token_ids=(5,), round=2, block_size=1, mode="plain-fallback"))
    stats.add(StreamChunk("fg", token_ids=(6, 7), drafted=1, accepted=1, round=3, block_size=2,
                          mode="lookup"))
    snap = stats.snapshot()
    assert (snap.lookup_rounds, snap.plain_rounds, snap.rounds) == (2, 1, 3)
    shown = speculation_text(snap).plain
    assert "prompt lookup 2/3 rounds" in shown and "plain fallback 1/3 rounds" in shown


def test_the_apps_round_modes_are_the_ones_the_service_streams():
    from dflash_chat import protocol

    from dflash_local.method.planning import modes

    assert (protocol.MODE_SPECULATIVE, protocol.MODE_FALLBACK, protocol.MODE_PROBE, protocol.MODE_LOOKUP) == (
        modes.SPECULATIVE, modes.FALLBACK, modes.PROBE, modes.LOOKUP)


def test_the_picker_marks_dflash2_drafters_only():
    from dflash_chat.screens.picker import pair_details

    pair = {"id": "p", "target": {"repo": "Qwen/Qwen3.8-27B"}, "block_size": {"vllm": 8},
            "thinking": "on", "drafter": {"repo": "z-lab/Qwen3.8-27B-DFlash2", "version": 2}}
    assert "drafter z-lab/Qwen3.8-27B-DFlash2 (DFlash 2)\n" in pair_details(pair)
    for v1 in ({"repo": "z-lab/X", "version": 1}, {"repo": "z-lab/X"}):  # older services: no field
        assert "drafter z-lab/X\n" in pair_details({**pair, "drafter": v1})


def test_the_picker_shows_the_fit_and_the_engines_this_machine_cannot_run():
    from dflash_chat.screens.picker import (
        download_fit_warning,
        engines_label,
        fit_details,
        fits_label,
    )

    from dflash_local.engines.selection import PlatformInfo
    from dflash_local.pairs.catalog import load_catalog
    from dflash_local.pairs.memory_budget import MachineMemory, budget_for
    from dflash_local.pairs.pair_fit import pair_fits

    mac = PlatformInfo("Darwin", "arm64", cuda=False, installed=frozenset({"mlx", "torch"}))
    budgets = {engine: budget_for(engine, mac, MachineMemory(16 * 2**30, 10 * 2**30, metal=True))
               for engine in ("mlx", "transformers", "vllm", "sglang")}
    catalog = load_catalog()

    def listed(pair_id: str) -> dict:
        pair = catalog.get(pair_id)
        return {**pair.to_json(), "fit": pair_fits(pair, budgets, 8192)}

    served = listed("qwen3.5-27b")  # vLLM and SGLang only: nothing runs on this Mac
    assert fits_label(served).plain == "n/a"
    assert [span.style for span in engines_label(served).spans] == ["dim strike", "dim strike"]
    assert fit_details(served)[0].startswith("vllm: cannot run here: needs a CUDA GPU")
    small = listed("qwen3.5-9b-mlx-4bit")
    fit = small["fit"]["mlx"]["fit"]
    assert fits_label(small).plain == f"{fit['max_context'] // 1024}k ctx"
    assert fit_details(small)[0].startswith(
        "mlx on Metal GPU (unified memory) (Metal's recommended working set): "
        f"fits up to {fit['max_context']:,} tokens of context")
    too_big = listed("qwen3.6-27b-mlx-bf16")  # 54.7 GB of weights against a 10 GiB working set
    assert fits_label(too_big).plain == "no"
    assert "does not fit: needs" in fit_details(too_big)[0] and "has 10.7 GB" in fit_details(too_big)[0]
    assert fits_label(listed("gemma-4-31b-it-mlx-4bit")).plain == "no"
    assert fits_label({"engines": ["mlx"]}).plain == "?"  # an older service: no estimate
    # a download's fit is the same per-engine figure: its warning is the label the picker shows
    assert download_fit_warning(too_big["fit"]) == too_big["fit"]["mlx"]["label"]
    assert download_fit_warning(small["fit"]) is None
    assert download_fit_warning(served["fit"]) is None and download_fit_warning(None) is None
    assert download_fit_warning({"fits": False, "label": "does not fit"}) is None  # older service


# --- issue 35: titles, search, an older store, attachments, colours on rendered text ---

def test_chat_titles_are_the_first_line_with_words():
    from dflash_chat.chat_text import TITLE_CHARS, chat_title

    assert chat_title("\n  Fix this bug  \n```py\nx = 1\n```") == "Fix this bug"
    long = chat_title("word " * 40)
    assert len(long) == TITLE_CHARS and long.endswith("…")


def test_search_finds_word_prefixes_across_chats_and_follows_edits(tmp_path):
    store = ChatStore(tmp_path / "chats.db")
    rust = store.create_chat("Rust")
    store.add_message(rust.id, "user", "How do lifetimes work in Rust?")
    python = store.create_chat("Python")
    reply = store.add_message(python.id, "assistant", "Use a generator", "streaming")
    assert [hit.chat.title for hit in store.search("lifetime")] == ["Rust"]
    assert "[lifetimes]" in store.search("lifetime")[0].snippet
    store.update_message(reply.id, "Use a dataclass", "done")
    assert store.search("generator") == [] and store.search("datacl")[0].chat.id == python.id
    assert store.search('"; DROP TABLE chats; --') == []  # words, never FTS5 syntax
    store.delete_chat(rust.id)
    assert store.search("lifetimes") == []


def test_a_store_an_older_app_wrote_gains_settings_and_search(tmp_path):
    import sqlite3

    from dflash_chat.storage_schema import SCHEMA

    path = tmp_path / "chats.db"
    old = sqlite3.connect(path)
    old.executescript(SCHEMA)  # the chats table had no settings column, and no search index
    old.execute("INSERT INTO chats (id, title, created, updated) VALUES (1, 'Old', 0, 0)")
    old.execute("INSERT INTO messages (chat_id, role, content, created) "
                "VALUES (1, 'user', 'an ancient question', 0)")
    old.commit()
    old.close()
    store = ChatStore(path)
    assert store.chat(1).settings == {} and store.search("ancient")[0].chat.title == "Old"
    store.set_chat_settings(1, {"pair": "embedded", "temperature": 0.5})
    assert store.chat(1).settings == {"pair": "embedded", "temperature": 0.5}


def test_attachments_follow_the_prompt_and_bad_files_are_refused(tmp_path):
    from dflash_chat.attachments import MAX_ATTACHMENT_BYTES, AttachmentError, expand_attachments

    (tmp_path / "a.py").write_text("x = 1\n")
    assert expand_attachments("see @a.py, mail @someone", tmp_path) == (
        "see @a.py, mail @someone\n\na.py:\n\n```\nx = 1\n```")
    assert expand_attachments("no file: @nobody.", tmp_path) == "no file: @nobody."
    (tmp_path / "blob").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(AttachmentError, match="not UTF-8 text"):
        expand_attachments("@blob", tmp_path)
    (tmp_path / "big").write_text("x" * (MAX_ATTACHMENT_BYTES + 1))
    with pytest.raises(AttachmentError, match="more than the"):
        expand_attachments("@big", tmp_path)


def test_rendered_text_takes_the_colour_of_the_source_it_shows():
    from dflash_chat.widgets.draft_colours import DRAFT_STYLE, align, coloured
    from textual.content import Content

    source = "Use **bold** and `code` here"
    rendered = "Use bold and code here"
    pairs = align(rendered, source)
    assert [source[i] for i in pairs if i is not None] == list(rendered)
    styles = [DRAFT_STYLE if source.index("bold") <= i < source.index("bold") + 4 else None
              for i in range(len(source))]
    painted = coloured(Content(rendered), source, styles, 0)
    assert [rendered[s.start:s.end] for s in painted.spans] == ["bold"]


def test_picker_columns_fit_the_width_pair_last():
    from dflash_chat.screens.picker import MIN_COLUMN, PAIR_MIN, fitted_widths

    widths = [22, 26, 9, 6, 10, 8, 6]
    assert fitted_widths(widths, 200) == widths
    narrow = fitted_widths(widths, 78)
    assert sum(narrow) + 2 * len(narrow) <= 78 and narrow[0] == PAIR_MIN
    assert min(fitted_widths(widths, 30)) == MIN_COLUMN


def test_a_stopped_reply_keeps_its_own_figures():
    stats = LiveStats(speculative=True)
    stats.sent_at = 9.5
    for index, (ids, accepted) in enumerate([([1], 0), ([2, 3, 4], 2), ([5, 6], 1)]):
        stats.add(chunk(ids, accepted, round_index=index, at=10.0 + index))
    totals = stats.totals()
    assert totals["tau"] == 2.5 and totals["completion_tokens"] == 6
    assert totals["decode_tokens_per_s"] == 2.5 and totals["ttft_s"] == 0.5
    assert totals["accepted_per_round"] == [0, 0, 1, 1]


def test_key_labels_read_as_the_keys_printed_on_a_keyboard():
    from dflash_chat.actions import key_label

    assert key_label("ctrl+right_square_bracket,f4") == "ctrl+], f4"
    assert key_label("ctrl+backslash") == "ctrl+\\"


def test_chat_list_titles_take_two_lines_at_most():
    from dflash_chat.widgets.chat_list import title_lines

    assert title_lines("Adding numbers") == "Adding numbers"
    two = title_lines("Write a Python function that reverses a string please")
    assert two == "Write a Python\nfunction that…"
    assert all(len(line) <= 20 for line in two.splitlines())


def test_the_picker_says_a_partial_download_is_incomplete():
    from dflash_chat.screens.picker import downloaded_label

    partial = {"target": "incomplete: resume or delete"}
    assert downloaded_label({"target": False, "drafter": True}, partial).plain == partial["target"]
    assert downloaded_label({"target": True, "drafter": True}, {}).plain == "yes"


def test_a_store_whose_search_predates_reasoning_is_indexed_again_with_it(tmp_path):
    import sqlite3

    from dflash_chat.storage_schema import SCHEMA

    path = tmp_path / "chats.db"
    old = sqlite3.connect(path)
    old.executescript(SCHEMA)
    old.execute("ALTER TABLE chats ADD COLUMN settings TEXT NOT NULL DEFAULT '{}'")
    old.execute("CREATE VIRTUAL TABLE messages_fts USING fts5(content, content='messages', "
                "content_rowid='id')")  # the index an app without reasoning search built
    old.execute("CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN "
                "INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content); END")
    old.execute("INSERT INTO chats (id, title, created, updated) VALUES (1, 'Old', 0, 0)")
    old.execute("INSERT INTO messages (chat_id, role, content, meta, created) VALUES "
                "(1, 'assistant', 'Hello there!', '{\"reasoning\": \"Greet back.\"}', 0)")
    old.commit()
    old.close()
    store = ChatStore(path)
    assert [(hit.snippet, hit.in_reasoning) for hit in store.search("greet")] == [
        ("[Greet] back.", True)]
    assert [(hit.snippet, hit.in_reasoning) for hit in store.search("hello")] == [
        ("[Hello] there!", False)]
    reply = store.add_message(1, "assistant", "Bye.", meta={"reasoning": "Wave goodbye."})
    store.update_message(reply.id, "Bye.", "done", {"reasoning": "Nod."})  # the index follows
    assert store.search("wave") == [] and store.search("nod")[0].in_reasoning
