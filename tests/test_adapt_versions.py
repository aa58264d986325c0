"""Adapted drafters' versions on disk (adapt/versions.py), no model needed: a kill -9 while a
version is written leaves the last good one serving and no half version; a corrupt version is
detected and skipped; a version made for another target is refused with the reason; a reset goes
back to the shipped drafter; the margin a candidate must win by; settings out of range refused,
naming the field."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dflash_local.adapt.idle import (
    PUBLISH,
    RESTART,
    TRAIN_ON,
    RoundSettings,
    better_by_margin,
    evenly_spaced,
    verdict,
)
from dflash_local.adapt.versions import PARTIAL_PREFIX, VersionStore, reset_versions
from dflash_local.errors import SettingsError

TARGET = {"path": "/models/target", "weights": [["model.safetensors", 10, 1]], "texts": {}}
RECORD = {"trained_on": 4, "tau_before": 1.5, "tau_after": 1.8, "at": "2026-01-01T00:00:00Z"}


def writer(payload: bytes):
    def write(directory: Path) -> None:
        (directory / "config.json").write_text("{}")
        (directory / "model.safetensors").write_bytes(payload)
    return write


def test_publish_serves_the_new_version_and_reset_returns_to_the_shipped(tmp_path):
    versions = VersionStore("pair", TARGET, tmp_path)
    assert versions.serving() is None  # nothing adapted: the shipped drafter
    first = versions.publish(writer(b"one"), RECORD)
    second = versions.publish(writer(b"two"), {**RECORD, "trained_on": 8})
    assert (first.number, second.number) == (1, 2)
    assert versions.serving().number == 2
    assert (second.path / "model.safetensors").read_bytes() == b"two"
    assert [entry["trained_on"] for entry in versions.history()] == [4, 8]
    assert set(versions.history()[0]) == {"version", "trained_on", "tau_before", "tau_after", "at"}
    assert versions.reset() == 2
    assert versions.serving() is None and versions.numbers() == []


def test_the_pointer_is_parsed_again_only_when_its_file_changes(tmp_path, monkeypatch):
    versions = VersionStore("pair", TARGET, tmp_path)
    versions.publish(writer(b"one"), RECORD)
    parses = []
    parse = versions._parse_pointer
    monkeypatch.setattr(versions, "_parse_pointer", lambda: parses.append(1) or parse())
    assert [versions.pointed() for _ in range(5)] == [1] * 5
    assert len(parses) == 1
    versions.publish(writer(b"two"), RECORD)
    assert versions.pointed() == 2 and len(parses) == 2
    versions.serve(None)
    assert versions.pointed() is None
    VersionStore("pair", TARGET, tmp_path).serve(1)  # another process's write
    assert versions.pointed() == 1


def test_adapt_reset_deletes_every_pairs_versions(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_LOCAL_HOME", str(tmp_path))
    for key in ("one", "two"):
        VersionStore(key, TARGET).publish(writer(b"w"), RECORD)
    assert reset_versions("one") == 1
    assert VersionStore("two", TARGET).serving().number == 1
    assert reset_versions() == 1 and VersionStore("two", TARGET).serving() is None


def test_a_corrupt_version_is_skipped_for_the_newest_good_one(tmp_path, caplog):
    versions = VersionStore("pair", TARGET, tmp_path)
    versions.publish(writer(b"good"), RECORD)
    bad = versions.publish(writer(b"fine until flipped"), RECORD)
    (bad.path / "model.safetensors").write_bytes(b"fine until flipped!")
    with caplog.at_level(logging.WARNING, logger="dflash_local.adapt"):
        assert versions.serving().number == 1
    assert "model.safetensors fails its checksum" in caplog.text
    (bad.path / "version.json").write_text("{not json")
    assert versions.serving().number == 1


def test_a_version_made_for_another_target_is_refused(tmp_path, caplog):
    VersionStore("pair", TARGET, tmp_path).publish(writer(b"w"), RECORD)
    other = VersionStore("pair", {**TARGET, "path": "/models/other-target"}, tmp_path)
    with caplog.at_level(logging.WARNING, logger="dflash_local.adapt"):
        assert other.serving() is None
    assert "made for another target (target) than the one loaded (other-target): refused" in caplog.text


def test_a_complete_version_the_pointer_does_not_name_yet_does_not_serve(tmp_path):
    """A kill between the rename and the pointer's replace: the previous version serves."""
    versions = VersionStore("pair", TARGET, tmp_path)
    versions.publish(writer(b"one"), RECORD)
    versions.publish(writer(b"two"), RECORD)
    versions.serve(1)
    assert versions.serving().number == 1


CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from dflash_local.adapt.versions import VersionStore
    versions = VersionStore("pair", {target!r}, Path(sys.argv[1]))
    def write(directory, big=False):
        (directory / "config.json").write_text("{{}}")
        with (directory / "model.safetensors").open("wb") as file:
            file.write(b"x" * 1000)
            file.flush()
            if big:
                print("writing", flush=True)
                time.sleep(60)  # killed here, mid-version
    versions.publish(write, {record!r})
    versions.publish(lambda directory: write(directory, big=True), {record!r})
""")


def test_kill_9_while_a_version_is_written_restarts_on_the_last_good_one(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(target=TARGET, record=RECORD),
                              str(tmp_path)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert child.stdout.readline().strip() == "writing"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    assert any(path.name.startswith(PARTIAL_PREFIX) for path in (tmp_path / "pair").iterdir())
    versions = VersionStore("pair", TARGET, tmp_path)  # a restart: the leftovers swept
    assert versions.serving().number == 1
    assert not any(path.name.startswith(PARTIAL_PREFIX) for path in versions.dir.iterdir())
    assert versions.publish(writer(b"next"), RECORD).number == 2  # numbering goes on


@pytest.mark.parametrize(("candidate", "serving", "better"), [
    ([3, 4, 3, 4, 3, 4], [1, 2, 1, 2, 1, 2], True),  # two more per block, every block
    ([1, 2, 1, 2, 1, 2], [3, 4, 3, 4, 3, 4], False),  # worse: kept out
    ([2, 2, 2, 2, 2, 2], [2, 2, 2, 2, 2, 2], False),  # the same: no version for nothing
    ([9, 0, 0, 0, 0, 0], [0, 1, 1, 1, 1, 0], False),  # one lucky block: within the noise
    ([5], [1], False),  # one block judges nothing
])
def test_a_candidate_serves_only_when_better_by_the_margin(candidate, serving, better):
    assert better_by_margin(candidate, serving) is better


@pytest.mark.parametrize(("candidate", "serving", "decided"), [
    ([3, 4, 3, 4, 3, 4], [1, 2, 1, 2, 1, 2], PUBLISH),
    ([1, 2, 1, 2, 1, 2], [3, 4, 3, 4, 3, 4], RESTART),  # astray: back to what serves
    ([0, 1, 1, 1, 1, 0], [9, 0, 0, 0, 0, 0], TRAIN_ON),  # worse on average, within the noise
    ([2, 2, 2, 2, 2, 2], [2, 2, 2, 2, 2, 2], TRAIN_ON),
])
def test_a_round_publishes_restarts_or_trains_on(candidate, serving, decided):
    assert verdict(candidate, serving) == decided


def test_held_out_blocks_are_spread_over_the_reply():
    sequence = {"tokens": list(range(40)), "prompt_len": 10}
    anchors = evenly_spaced(sequence, 4)
    assert anchors == sorted(anchors) and len(anchors) == 4
    assert anchors[0] == 9 and anchors[-1] <= 38
    assert evenly_spaced({"tokens": [1, 2], "prompt_len": 1}, 4) == []


@pytest.mark.parametrize("fields, message", [
    ({"lr": -1e-5}, "AdaptSettings.lr must be a learning rate in [0, 0.1], got -1e-05"),
    ({"lr": float("nan")}, "AdaptSettings.lr must be"),
    ({"lr": "3e-5"}, "AdaptSettings.lr must be a learning rate in [0, 0.1], got '3e-5'"),
    ({"replay_share": 1.5}, "AdaptSettings.replay_share must be a share in [0, 1], got 1.5"),
    ({"max_reply_tokens": 1}, "AdaptSettings.max_reply_tokens must be an int >= 2"),
])
def test_bad_trainer_settings_are_refused_naming_the_field(fields, message):
    from dflash_local.adapt.trainer import AdaptSettings

    with pytest.raises(SettingsError) as refused:
        AdaptSettings(**fields)
    assert str(refused.value).startswith(message)


@pytest.mark.parametrize("fields, message", [
    ({"steps_per_new_reply": 0}, "RoundSettings.steps_per_new_reply must be an int >= 1, got 0"),
    ({"max_steps": 2.5}, "RoundSettings.max_steps must be an int >= 1, got 2.5"),
    ({"held_out": 1, "min_held_out": 2}, "RoundSettings.held_out must be an int >= min_held_out (2), got 1"),
    ({"max_tapped": 8}, "RoundSettings.max_tapped must be an int > held_out (8)"),
    ({"slice_budget_s": -0.1}, "RoundSettings.slice_budget_s must be a number of seconds > 0, got -0.1"),
])
def test_bad_round_settings_are_refused_naming_the_field(fields, message):
    with pytest.raises(SettingsError) as refused:
        RoundSettings(**fields)
    assert str(refused.value).startswith(message)
