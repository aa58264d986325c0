"""The first start's one-off import of the embedded model is a loading phase of its own (issue
51: minutes of an unexplained "loading model"), seen by serve's phase printer and in
/dflash/status while it runs, then "loading" for the weights. The import itself (minutes) is
stood in for: by its failure, or by a directory that is no checkpoint (the load then fails)."""

from __future__ import annotations

import pytest

from dflash_local.errors import CheckpointError
from dflash_local.pairs import embedded
from dflash_local.service import state as state_module
from dflash_local.service.state import ServiceState


def load_embedded_watching_phases(tmp_path, monkeypatch, imported) -> list:
    monkeypatch.setattr(embedded, "embedded_target_dir", lambda: tmp_path / "not-imported")
    seen, real_locate = [], state_module.locate

    def importing(model, prepare=False, cache_dir=None):
        if model.source != "embedded":  # the drafter: where it really is
            return real_locate(model, prepare=prepare, cache_dir=cache_dir)
        seen.append(("import ran", model.source, prepare))
        return imported()

    monkeypatch.setattr(state_module, "locate", importing)
    service = ServiceState(on_loading_phase=lambda name, phase: seen.append(
        (name, phase, service.loading, service.loading_phase)))
    with pytest.raises(CheckpointError):
        service.load_pair("embedded")
    assert (service.loading, service.loading_phase) == (None, None)  # over, even when it failed
    return seen


def test_a_failed_import_was_announced_before_it_ran(tmp_path, monkeypatch):
    def failed():
        raise CheckpointError("the GGUF is damaged")

    assert load_embedded_watching_phases(tmp_path, monkeypatch, failed) == [
        ("embedded", "importing", "embedded", "importing"), ("import ran", "embedded", True)]


def test_an_import_hands_over_to_loading(tmp_path, monkeypatch):
    assert load_embedded_watching_phases(tmp_path, monkeypatch, lambda: tmp_path) == [
        ("embedded", "importing", "embedded", "importing"), ("import ran", "embedded", True),
        ("embedded", "loading", "embedded", "loading")]
