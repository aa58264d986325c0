"""Regenerated data saved without its taps and put back by one forward pass per sequence: the
same tokens, the taps regeneration gave, prompts already present skipped, clear errors for an
archive of another tokenizer or a damaged one, and the CLI's round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import make_target

from dflash_local.cli.main import main
from dflash_local.errors import CheckpointError


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_target(tmp_path_factory.mktemp("archive") / "target", family="llama", layers=4, hidden=64)


@pytest.fixture(scope="module")
def loaded(target):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(target))


@pytest.fixture(scope="module")
def fingerprint(target) -> str:
    from dflash_local.drafter.config import load_target_info
    from dflash_local.train.token_archive import target_fingerprint

    return target_fingerprint(load_target_info(target))


def by_prompt(sequences: list[dict]) -> dict:
    from dflash_local.train.regenerate import prompt_key

    return {prompt_key(s): s for s in sequences}


def test_retapped_sequences_are_the_regenerated_ones_with_their_taps(loaded, fingerprint, tmp_path):
    from dflash_local.train.regenerate import regenerate
    from dflash_local.train.token_archive import load_tokens, retap, save_tokens
    from dflash_local.train.trainer import load_sequences

    model, tokenizer = loaded
    prompts = [f"Say something about {word}." for word in ("rivers", "salt", "owls", "glass", "tea")]
    regenerate(model, tokenizer, prompts, (1, 3), tmp_path / "regen", batch_size=2, max_new_tokens=9)
    regenerated = load_sequences(tmp_path / "regen")
    archive = save_tokens(regenerated, tmp_path / "data.npz", tokenizer, fingerprint)

    restored = load_tokens(archive, tokenizer, fingerprint)
    assert retap(model, restored[:2], (1, 3), tmp_path / "moved", batch_size=2) == 2
    assert retap(model, restored, (1, 3), tmp_path / "moved", batch_size=3) == len(restored) - 2
    assert retap(model, restored, (1, 3), tmp_path / "moved") == 0  # nothing twice
    before, after = by_prompt(regenerated), by_prompt(load_sequences(tmp_path / "moved"))
    assert len(before) == 5 and before.keys() == after.keys()
    for prompt, old in before.items():
        new = after[prompt]
        assert torch.equal(new["tokens"], old["tokens"]) and new["prompt_len"] == old["prompt_len"]
        assert new["tokens"].dtype == old["tokens"].dtype == torch.int32  # the validation split hashes them
        assert new["taps"].shape == old["taps"].shape == (len(old["tokens"]) - 1, 2 * 64)
        # left-padded cached decoding vs one right-padded forward: the same states, to bf16
        torch.testing.assert_close(new["taps"].float(), old["taps"].float(), atol=0.05, rtol=0.02)
    # the archive is small: ids only
    assert archive.stat().st_size < 4 * sum(len(s["tokens"]) for s in regenerated) + 2048


def test_an_archive_of_another_tokenizer_or_target_or_a_damaged_one_is_refused(loaded, fingerprint, tmp_path):
    import numpy as np

    from dflash_local.train.token_archive import load_tokens, save_tokens

    _, tokenizer = loaded
    ours = fingerprint
    sequences = [{"tokens": torch.tensor([5, 6, 7, 8], dtype=torch.int32), "prompt_len": 2}]
    archive = save_tokens(sequences, tmp_path / "a.npz", tokenizer, ours)
    assert [s["tokens"].tolist() for s in load_tokens(archive, tokenizer, ours)] == [[5, 6, 7, 8]]

    class OtherTokenizer:
        def get_vocab(self):
            return {**tokenizer.get_vocab(), "<extra>": 10_000}

    with pytest.raises(CheckpointError, match="another tokenizer .* than this target's"):
        load_tokens(archive, OtherTokenizer(), ours)
    with pytest.raises(CheckpointError, match=r"another target \(llama/4x64/vocab \d+\) than this one \(llama/12x"):
        load_tokens(archive, tokenizer, ours.replace("/4x", "/12x"))
    damaged = tmp_path / "damaged.npz"
    damaged.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="is not a readable token archive"):
        load_tokens(damaged, tokenizer, ours)
    np.save(tmp_path / "array.npy", np.arange(4))
    with pytest.raises(CheckpointError, match="is not a readable token archive"):
        load_tokens(tmp_path / "array.npy", tokenizer, ours)
    with np.load(archive) as fields:
        inconsistent = {**fields, "prompt_lens": np.array([4])}  # the whole sequence is prompt
    np.savez(tmp_path / "bad.npz", **inconsistent)
    with pytest.raises(CheckpointError, match="sequence 0 has a prompt of 4 tokens in 4"):
        load_tokens(tmp_path / "bad.npz", tokenizer, ours)
    with pytest.raises(CheckpointError, match="no token archive at"):
        load_tokens(tmp_path / "none.npz", tokenizer, ours)
    with pytest.raises(CheckpointError, match="no regenerated sequences to save"):
        save_tokens([], tmp_path / "empty.npz", tokenizer, ours)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(CheckpointError, match="could not write the token archive .*a-file/b.npz"):
        save_tokens(sequences, tmp_path / "a-file" / "b.npz", tokenizer, ours)


def test_the_cli_saves_the_data_and_trains_elsewhere_from_the_archive(target, loaded, fingerprint,
                                                                    tmp_path, capsys):
    from dflash_local.train.token_archive import load_tokens

    archive = tmp_path / "tokens.npz"
    assert main(["train", "--target", str(target), "--out", str(tmp_path / "first"),
                 "--data", str(tmp_path / "data"), "--prompts-limit", "12", "--max-new-tokens", "8",
                 "--batch-size", "8", "--regen-minutes", "2", "--steps", "0", "--taps", "1,3",
                 "--save-tokens", str(archive)]) == 0
    assert not (tmp_path / "first").exists()  # --steps 0: data only, no throwaway drafter
    sequences = load_tokens(archive, loaded[1], fingerprint)
    responses = sum(len(s["tokens"]) - s["prompt_len"] for s in sequences)
    printed = capsys.readouterr().out
    assert f"{len(sequences)} sequences, {responses} response tokens" in printed
    assert f"saved {len(sequences)} sequences to {archive}" in printed
    # saving again needs neither the data's --taps (not the default here) nor a drafter's shape
    assert main(["train", "--target", str(target), "--out", str(tmp_path / "first"),
                 "--data", str(tmp_path / "data"), "--regen-minutes", "0", "--steps", "0",
                 "--save-tokens", str(tmp_path / "again.npz")]) == 0
    again = load_tokens(tmp_path / "again.npz", loaded[1], fingerprint)
    assert [(s["tokens"].tolist(), s["prompt_len"]) for s in again] == [
        (s["tokens"].tolist(), s["prompt_len"]) for s in sequences]

    assert main(["train", "--target", str(target), "--out", str(tmp_path / "second"),
                 "--data", str(tmp_path / "elsewhere"), "--tokens", str(archive),
                 "--regen-minutes", "0", "--steps", "3", "--layers", "1", "--block-size", "4",
                 "--draft-vocab", "0"]) == 0
    report = json.loads((tmp_path / "second" / "training_report.json").read_text())
    assert report["steps"] == 3
    assert (report["sequences"], report["regenerated_tokens"]) == (len(sequences), responses)

    assert main(["train", "--target", str(target), "--out", str(tmp_path / "third"),
                 "--tokens", str(tmp_path / "missing.npz")]) == 2
    assert f"--tokens: no such file: {tmp_path / 'missing.npz'}" in capsys.readouterr().err


def test_the_shipped_token_archives_load_for_the_embedded_target(embedded_target_dir):
    """The archives in models/training-data name the embedded target as this code fingerprints it:
    a change of fingerprint would orphan them."""
    from transformers import AutoTokenizer

    from dflash_local.drafter.config import load_target_info
    from dflash_local.train.token_archive import load_tokens, target_fingerprint

    archives = sorted((Path(__file__).parents[1] / "models" / "training-data").glob("*.npz"))
    assert archives
    tokenizer = AutoTokenizer.from_pretrained(embedded_target_dir)
    fingerprint = target_fingerprint(load_target_info(embedded_target_dir))
    assert fingerprint == "llama/30x576/vocab 49152"
    for archive in archives:
        sequences = load_tokens(archive, tokenizer, fingerprint)
        assert len(sequences) > 1000 and all(len(s["tokens"]) > s["prompt_len"] for s in sequences)
