"""The training recipe, on tiny random-weight targets: one command end to end (regenerate, train,
a z-lab-format directory the engines load), resume after a kill, the block-sparse batches, the
clear refusals (no corpus, no MASK row), and the autoregressive draft peer."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from fixtures_tiny import collect
from tiny_models import make_target

from dflash_local.cli.main import main
from dflash_local.errors import DFlashError
from dflash_local.events import GenerationParams, parse_block_size


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_target(tmp_path_factory.mktemp("train") / "target", layers=4, hidden=64)


def test_one_command_makes_a_drafter_the_engine_loads_and_runs_losslessly(target, tmp_path):
    from dflash_local.drafter.config import check_compatible, load_drafter_config, load_target_info
    from dflash_local.engines.torch_engine import TorchEngine

    out = tmp_path / "drafter"
    code = main(["train", "--target", str(target), "--out", str(out), "--data", str(tmp_path / "data"),
                 "--prompts-limit", "20", "--max-new-tokens", "12", "--batch-size", "16",
                 "--regen-minutes", "2", "--steps", "6", "--layers", "1", "--block-size", "4",
                 "--draft-vocab", "40"])
    assert code == 0
    vocab = json.loads((out / "draft_vocab.json").read_text())
    assert len(vocab["token_ids"]) == 40 and vocab["token_ids"] == sorted(vocab["token_ids"])
    assert 0 < vocab["coverage"] <= 1
    assert 0 < vocab["counted_tokens"] < report_tokens(out)  # the training split only
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"]["mask_token_id"] == 3  # <|mask|>, found among the specials
    assert check_compatible(load_drafter_config(out), load_target_info(target)) == []
    report = json.loads((out / "training_report.json").read_text())
    assert report["steps"] == 6 and report["regenerated_tokens"] > 0
    assert set(report["held_out"]) == {"loss", "acc1", "tau"} and report["held_out"]["tau"] >= 1.0

    engine = TorchEngine(target, out)
    assert engine.pair.draft_vocab_size == 40
    prompt = engine.encode_chat([{"role": "user", "content": "Hello there"}])
    spec, _ = collect(engine.stream(prompt, GenerationParams(max_tokens=20, block_size=parse_block_size(4))))
    plain, _ = collect(engine.stream(prompt, GenerationParams(max_tokens=20, speculative=False)))
    assert spec == plain


def report_tokens(out: Path) -> int:
    return json.loads((out / "training_report.json").read_text())["regenerated_tokens"]


def test_a_restricted_drafter_trains_over_its_set_and_a_label_outside_it_is_a_miss(target):
    from dflash_local.train.batches import make_batch
    from dflash_local.train.trainer import _draft_indices, batch_loss

    labels = torch.tensor([[-100, 7, 9, 4]])
    assert _draft_indices(labels, torch.tensor([4, 7]), vocab_size=12).tolist() == [[-100, 1, -100, 0]]

    drafter, _ = tiny_drafter(target)
    sequences = synthetic_sequences(3, hidden_in=2 * 64, seed=4)
    batch = make_batch(sequences, 4, 4, 3, 2.0, random.Random(0))
    full_loss, full_metrics = batch_loss(drafter, batch)
    in_data = sorted({int(t) for t in batch.labels.flatten() if t >= 0})
    drafter.restrict_draft_vocab(in_data)  # every label is in the set: only the head shrinks
    loss, metrics = batch_loss(drafter, batch)
    assert loss < full_loss  # fewer competitors in the softmax
    assert metrics["tau"] >= full_metrics["tau"]
    loss.backward()
    assert drafter.fc.weight.grad is not None
    head_weight = drafter._draft_head[0].weight  # a frozen copy of target rows, never optimised
    assert not head_weight.requires_grad and all(p is not head_weight for p in drafter.parameters())
    first_drafts = batch.labels.view(3, -1, 4)[..., 1]  # the label at block position 1
    token = int(first_drafts[0, 0])
    drafter.restrict_draft_vocab([token])  # it can only propose `token`: right where that is the label
    loss, single = batch_loss(drafter, batch)
    expected = (first_drafts[first_drafts != -100] == token).float().mean().item()
    assert 0 < expected < 1 and single["acc1"] == pytest.approx(expected)  # the others: misses
    assert float(loss.detach()) == 0.0  # one class: no loss where it is the label, none elsewhere


def test_a_resumed_run_keeps_its_draft_vocabulary_and_zero_removes_a_stale_one(tmp_path):
    from dflash_local.train.cli import choose_training_draft_vocab
    from dflash_local.train.trainer import checkpoint_path_for

    out = tmp_path / "drafter"
    first = choose_training_draft_vocab(out, synthetic_sequences(30, 8, seed=1), 20, vocab_size=260)
    assert json.loads((out / "draft_vocab.json").read_text())["token_ids"] == first
    more_data = synthetic_sequences(30, 8, seed=2)
    checkpoint_path_for(out).write_bytes(b"")  # a run that started: its set must not move
    assert choose_training_draft_vocab(out, more_data, 20, vocab_size=260) == first
    checkpoint_path_for(out).unlink()  # a fresh run on the new data chooses again
    assert choose_training_draft_vocab(out, more_data, 20, vocab_size=260) != first
    assert choose_training_draft_vocab(out, more_data, 0, vocab_size=260) is None
    assert not (out / "draft_vocab.json").exists()


def test_continuing_a_drafter_keeps_its_draft_vocabulary_when_the_size_matches(tmp_path):
    from dflash_local.train.cli import choose_training_draft_vocab

    first = tmp_path / "first"
    inherited = choose_training_draft_vocab(first, synthetic_sequences(30, 8, seed=1), 20, vocab_size=260)
    new_data = synthetic_sequences(30, 8, seed=2)
    assert choose_training_draft_vocab(tmp_path / "fresh", new_data, 20, vocab_size=260) != inherited
    second = tmp_path / "second"
    assert choose_training_draft_vocab(second, new_data, 20, vocab_size=260, init_from=first) == inherited
    assert json.loads((second / "draft_vocab.json").read_text())["token_ids"] == inherited
    # another size asked for: chosen from the data, as without --init-from
    assert len(choose_training_draft_vocab(tmp_path / "third", new_data, 12, vocab_size=260,
                                           init_from=first)) == 12


def test_a_negative_draft_vocabulary_is_refused(target, tmp_path, capsys):
    assert main(["train", "--target", str(target), "--out", str(tmp_path / "d"), "--draft-vocab", "-1"]) == 2
    assert "--draft-vocab must be 0 (the full head) or a positive count, got -1" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "message"), [
    (["--steps", "-3"], "--steps must be 0 (regenerate only) or a positive count, got -3"),
    (["--taps", "1,x"], "--taps wants comma-separated layer numbers, got '1,x'"),
    (["--taps", "0,4,9"], "--taps 4,9: the target's layers are 0..3"),
    (["--block-size", "1"], "--layers must be >= 1 and --block-size >= 2, got None and 1"),
    (["--train-minutes", "0"], "--train-minutes must be positive (or give --steps), got 0.0"),
    (["--prompt-variants", "-1"], "prompt variants must be >= 0, got -1"),
    (["--prompt-variants", "1", "--prompt-variants-from", "2"],
     "--prompt-variants-from must be between 0 and --prompt-variants (1), got 2"),
    (["--prompt-corpus", "/no/such/dir"], "--prompt-corpus /no/such/dir is not a directory"),
    (["--chat-prompts", "--prompt-variants", "1"], "--chat-prompts replaces the default prompts"),
    (["--chat-prompts", "--prompt-corpus", "."], "--chat-prompts replaces the default prompts"),
    (["--chat-prompts", "--prompts-limit", "50"], "--chat-prompts replaces the default prompts"),
    (["--chat-followups", "--prompt-corpus", "."], "--chat-followups replaces the default prompts"),
    (["--chat-prompts", "--chat-followups"], "--chat-followups continues the answers to --chat-prompts"),
    (["--chat-followups", "--regen-minutes", "0"], "--chat-followups chooses the prompts to regenerate"),
])
def test_meaningless_training_options_are_refused(target, tmp_path, capsys, flags, message):
    assert main(["train", "--target", str(target), "--out", str(tmp_path / "d"), *flags]) == 2
    assert message in capsys.readouterr().err


def test_the_warm_up_only_steepens_once_a_budgeted_runs_length_is_known():
    from dflash_local.train.trainer import StepBudget, TrainSettings, lr_at

    settings = TrainSettings(lr=1e-3)
    measured = StepBudget.SKIP + StepBudget.MEASURE  # steps run before the length is known
    for total in (30, 500, 5_000, 50_000):
        before = [lr_at(step, None, settings) for step in range(measured)]
        after = lr_at(measured, total, settings)
        assert before == sorted(before) and before[-1] <= after, total  # no peak, then no drop


def synthetic_sequences(count: int, hidden_in: int, seed: int = 0) -> list[dict]:
    rng = torch.Generator().manual_seed(seed)
    sequences = []
    for _ in range(count):
        length = int(torch.randint(20, 40, (1,), generator=rng))
        tokens = torch.randint(10, 200, (length,), generator=rng, dtype=torch.int32)
        sequences.append({"tokens": tokens, "prompt_len": 8,
                          "taps": torch.randn(length - 1, hidden_in, generator=rng)})
    return sequences


def tiny_drafter(target: Path):
    from transformers import AutoModelForCausalLM

    from dflash_local.drafter.model_torch import DFlashDrafter
    from dflash_local.train.trainer import drafter_config_for

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    torch.manual_seed(0)
    drafter = DFlashDrafter(drafter_config_for(model.config, 1, 4, (1, 2), mask_token_id=3))
    drafter.bind(model.get_input_embeddings(), model.get_output_embeddings())
    return drafter, model


def test_a_killed_run_resumes_from_its_last_checkpoint(target, tmp_path, monkeypatch):
    from dflash_local.train.trainer import TrainSettings, train

    settings = TrainSettings(block_size=4, gamma=2.0, anchors_per_seq=2, seqs_per_step=2,
                             steps=6, checkpoint_every=2)
    sequences = synthetic_sequences(20, 2 * 64)
    out = tmp_path / "drafter"

    uninterrupted, _ = tiny_drafter(target)
    full = train(uninterrupted, sequences, tmp_path / "reference", settings)

    killed, _ = tiny_drafter(target)
    real_step = torch.optim.AdamW.step
    calls = {"n": 0}

    def dies_at_the_fifth_step(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", dies_at_the_fifth_step)
    with pytest.raises(KeyboardInterrupt):
        train(killed, sequences, out, settings)
    monkeypatch.setattr(torch.optim.AdamW, "step", real_step)
    saved = torch.load(out.parent / "drafter.checkpoint.pt", weights_only=False)
    assert saved["state"]["step"] == 4  # the last checkpoint before the kill

    resumed, _ = tiny_drafter(target)  # a fresh process: fresh weights, then the checkpoint
    report = train(resumed, sequences, out, settings)
    assert report["steps"] == 6
    losses = [round(h["loss"], 4) for h in report["history_tail"]]
    assert losses == [round(h["loss"], 4) for h in full["history_tail"]]  # as if never killed


def test_blocks_see_only_context_before_their_anchor_and_their_own_block():
    from dflash_local.train.batches import make_batch, position_weights

    sequence = {"tokens": torch.arange(100, 130, dtype=torch.int32), "prompt_len": 5,
                "taps": torch.randn(29, 8)}
    batch = make_batch([sequence], anchors_per_seq=3, block_size=4, mask_token_id=7, gamma=2.0,
                       rng=random.Random(0))
    context = batch.taps.shape[1]
    for block in range(3):
        rows = slice(4 * block, 4 * block + 4)
        anchor = int(batch.block_pos[0, rows.start])
        assert int(batch.block_ids[0, rows.start]) == 100 + anchor
        assert batch.block_ids[0, rows.start + 1 : rows.stop].eq(7).all()  # MASKs after the anchor
        seen = batch.mask[0, 0, rows]
        assert seen[:, :anchor].all() and not seen[:, anchor:context].any()  # strictly before
        own = torch.zeros(12, dtype=torch.bool)
        own[rows] = True
        assert (seen[:, context:] == own).all()  # its own block (both ways), no other block
        # labels are the next tokens; past the sequence's end there is nothing to learn
        assert batch.labels[0, rows].tolist() == [100 + anchor + k if anchor + k < 30 else -100
                                                  for k in range(4)]
    assert torch.allclose(batch.weights[0, :4], position_weights(4, 2.0))
    assert batch.weights[0, 0] == 0  # the anchor itself is given, not learned


def test_init_from_continues_the_drafters_shape_and_refuses_another(target, tmp_path, capsys):
    from dflash_local.drafter.config import load_drafter_config

    data = tmp_path / "data"
    data.mkdir()
    torch.save(synthetic_sequences(24, 128), data / "regen-00000.pt")  # 2 taps x hidden 64
    common = ["--target", str(target), "--data", str(data), "--regen-minutes", "0", "--steps", "2",
              "--draft-vocab", "0"]
    first = tmp_path / "first"
    assert main(["train", "--out", str(first), "--layers", "1", "--block-size", "4", "--taps", "0,2",
                 *common]) == 0
    second = tmp_path / "second"  # no shape options: the first drafter's shape, not the defaults
    assert main(["train", "--out", str(second), "--init-from", str(first), *common]) == 0
    assert load_drafter_config(second) == load_drafter_config(first)
    assert json.loads((second / "training_report.json").read_text())["init_from"] == str(first)
    capsys.readouterr()

    assert main(["train", "--out", str(tmp_path / "third"), "--init-from", str(first),
                 "--block-size", "8", "--taps", "0,2", *common]) == 2
    err = capsys.readouterr().err
    assert "is a different drafter: --block-size 8 (it has 4)" in err and "--taps" not in err

    other = make_target(tmp_path / "other", layers=4, hidden=32)
    assert main(["train", "--out", str(tmp_path / "fourth"), "--init-from", str(first),
                 *common[2:], "--target", str(other)]) == 2
    assert "hidden_size 64 != target hidden_size 32" in capsys.readouterr().err
    assert main(["train", "--kind", "ar", "--out", str(tmp_path / "ar"), "--init-from", str(first),
                 *common]) == 2
    assert "--kind ar starts from the target" in capsys.readouterr().err
    # data of other taps: refused by its width, and by its record where the data has one
    assert main(["train", "--out", str(tmp_path / "fifth"), "--taps", "0,1,2", *common]) == 2
    assert "are 128 wide; 3 taps of hidden size 64 (0,1,2) need 192" in capsys.readouterr().err
    from dflash_local.train.regenerate import DATA_INFO, record_data_taps

    record_data_taps(data, (0, 2), 64)  # shards of unknown layers already there: no record
    assert not (data / DATA_INFO).exists()
    recorded = tmp_path / "recorded"
    recorded.mkdir()
    record_data_taps(recorded, (0, 2), 64)
    record_data_taps(recorded, (0, 2), 64)  # the same layers again: fine
    (recorded / "regen-00000.pt").write_bytes((data / "regen-00000.pt").read_bytes())
    recorded_args = [*common[:2], "--data", str(recorded), *common[4:]]
    assert main(["train", "--out", str(tmp_path / "sixth"), "--taps", "1,3", *recorded_args]) == 2
    assert "holds taps of target layers [0, 2]" in capsys.readouterr().err
    # legacy data mixing two tap widths: refused, both widths named
    torch.save(synthetic_sequences(8, 192, seed=1), data / "regen-00001.pt")
    assert main(["train", "--out", str(tmp_path / "seventh"), *common]) == 2
    assert "are 128, 192 wide" in capsys.readouterr().err


def test_no_corpus_and_no_mask_row_are_clear_errors(tmp_path, embedded_target_dir):
    from tokenizers import Tokenizer, models
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from dflash_local.train.shape import choose_mask_token
    from dflash_local.train.trainer import load_sequences

    with pytest.raises(DFlashError, match="no regenerated data"):
        load_sequences(tmp_path)
    plain = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "b": 1}, "a")))
    with pytest.raises(DFlashError, match="no usable MASK row.*--mask-token"):
        choose_mask_token(plain, None)
    with pytest.raises(DFlashError, match="not a token"):
        choose_mask_token(plain, "<mask>")
    # SmolLM2 has no MASK token: the recipe takes <empty_output>, a special token its
    # instruct data never emits, so its row is free to learn "unknown yet"
    smollm2 = AutoTokenizer.from_pretrained(embedded_target_dir)
    assert choose_mask_token(smollm2, None) == smollm2.convert_tokens_to_ids("<empty_output>")


def test_the_ar_draft_peer_shares_the_targets_tables_and_loads_as_a_causal_lm(target, tmp_path):
    from transformers import AutoModelForCausalLM

    from dflash_local.train.ar_draft import ar_draft_from_target, train_ar_draft
    from dflash_local.train.trainer import TrainSettings

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    draft = ar_draft_from_target(model, layers=2)
    embeddings = draft.model.embed_tokens.weight.clone()
    report = train_ar_draft(draft, synthetic_sequences(20, 8), tmp_path / "ar",
                            TrainSettings(steps=3, lr=1e-3), batch_seqs=4)
    assert report["steps"] == 3
    assert torch.equal(draft.model.embed_tokens.weight, embeddings)  # frozen
    assert torch.equal(embeddings, model.model.embed_tokens.weight)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ar")
    assert loaded.config.num_hidden_layers == 2 and loaded.config.vocab_size == model.config.vocab_size


def test_the_ar_draft_command_writes_a_directory_mlx_lm_reads(target, tmp_path):
    pytest.importorskip("mlx_lm")  # mlx[cpu] is a dependency on Linux: present in CI
    from mlx_lm import load

    data = tmp_path / "data"
    data.mkdir()
    torch.save(synthetic_sequences(24, 8), data / "regen-00000.pt")
    out = tmp_path / "ar"
    assert main(["train", "--kind", "ar", "--target", str(target), "--out", str(out), "--data",
                 str(data), "--regen-minutes", "0", "--steps", "2", "--layers", "1"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and "rope_theta" in config
    model, tokenizer = load(str(out))
    assert tokenizer.vocab_size == config["vocab_size"] and len(model.layers) == 1


def test_regeneration_resumes_by_prompt_and_a_longer_list_only_adds(target, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_local.train.regenerate import prompt_key, regenerate
    from dflash_local.train.trainer import load_sequences

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = [f"Tell me about the number {n}." for n in range(6)]
    data = tmp_path / "data"
    regenerate(model, tokenizer, prompts[:4], (1, 2), data, batch_size=2, max_new_tokens=5, shard_batches=1)
    first = {p.name: p.stat().st_mtime_ns for p in data.glob("regen-*.pt")}
    assert len(first) == 2 and len(load_sequences(data)) == 4

    (data / "regen-00001.prompts.json").unlink()  # a shard from before the index: re-indexed
    regenerate(model, tokenizer, prompts, (1, 2), data, batch_size=2, max_new_tokens=5, shard_batches=1)
    shards = {p.name: p.stat().st_mtime_ns for p in data.glob("regen-*.pt")}
    assert {name: shards[name] for name in first} == first  # nothing regenerated twice
    assert sorted(shards) == ["regen-00000.pt", "regen-00001.pt", "regen-00002.pt"]
    sequences = load_sequences(data)
    prompt_ids = [prompt_key(s) for s in sequences]
    assert len(sequences) == 6 and len(set(prompt_ids)) == 6


def test_prompt_variants_never_carry_a_held_out_docstring_into_training():
    from dflash_local.train.prompts import (
        all_prompts,
        docstring_prompts,
        is_held_out,
        split_prompts,
        training_prompts,
        variant_prompts,
    )

    base = training_prompts(limit=400)
    more = training_prompts(limit=400, variants=2)
    held_out = split_prompts(all_prompts(limit=400))[1]
    assert more[: len(base)] == base and len(more) > 2 * len(base) - 200  # adds, keeps the old order
    assert not set(more) & set(held_out)
    assert len(more) == len(set(more))
    # no other framing of a held-out docstring trains
    from dflash_local.train.prompts import _docstring_groups

    held_groups = [g for g in _docstring_groups(None, 400, 0) if is_held_out(g[0])]
    assert held_groups  # the split is not empty at this size
    leaked = {p for g in held_groups for p in g[1:]} & set(variant_prompts(2, limit=400))
    assert not leaked
    assert docstring_prompts(limit=400) == [g[0] for g in _docstring_groups(None, 400, 0)]


def test_later_prompt_variants_alone_are_what_they_add_to_the_earlier_list():
    from dflash_local.train.prompts import training_prompts

    earlier = training_prompts(limit=400, variants=1)
    everything = training_prompts(limit=400, variants=3)
    later = training_prompts(limit=400, variants=3, variants_from=2)
    assert later and not set(later) & set(earlier)
    assert later == [p for p in everything if p not in set(earlier)]  # same order
    assert training_prompts(limit=400, variants=3, variants_from=0) == everything
    with pytest.raises(DFlashError, match="prompt-variants-from must be between 0 and"):
        training_prompts(limit=10, variants=1, variants_from=2)


def test_another_corpus_brings_its_docstrings_but_never_a_held_out_stdlib_one(tmp_path):
    import random

    from dflash_local.train.prompts import (
        CHAT_PROMPTS,
        DEFAULT_LIMIT,
        FRAMINGS,
        _docstring_groups,
        _groups_from_file,
        is_held_out,
        training_prompts,
    )

    # a held-out stdlib function vendored into the corpus, where its first framing is not held out
    corpus = tmp_path  # its name holds "test": only test folders inside a corpus are skipped
    (corpus / "pkg").mkdir()
    explain = FRAMINGS[0].format(code="")
    vendored = None
    for group in _docstring_groups(None, DEFAULT_LIMIT, 0):
        code = next((p.removeprefix(explain) for p in group if p.startswith(explain)), None)
        if not is_held_out(group[0]) or code is None:
            continue
        (corpus / "vendored.py").write_text(code + "\n")
        copied = _groups_from_file(corpus / "vendored.py", random.Random(0))
        if copied and set(copied[0]) == set(group) and not is_held_out(copied[0][0]):
            vendored = group
            break
    assert vendored is not None
    # the same code vendored with edits (its docstring reworded at the start, a `def` renamed
    # where it has one): no prompt in common with the held-out one, and still a copy of it
    quote = min((q for q in ('"""', "'''") if q in code), key=code.index)
    edited = code.replace(quote, quote + "Vendored here: ", 1).replace("def ", "def vendored_", 1)
    (corpus / "pkg" / "edited.py").write_text(edited + "\n")
    edited_group = _groups_from_file(corpus / "pkg" / "edited.py", random.Random(0))[0]
    assert not set(edited_group) & set(vendored) and not is_held_out(edited_group[0])
    (corpus / "pkg" / "rows.py").write_text(
        'def fetch_rows(table):\n'
        '    """Fetch every row of the frobnicator table and return them as plain tuples."""\n'
        '    return list(table)\n')
    (corpus / "tests").mkdir()
    (corpus / "tests" / "rows.py").write_text((corpus / "pkg" / "rows.py").read_text().replace("frob", "snark"))
    (corpus / "top.py").write_text((corpus / "pkg" / "rows.py").read_text().replace("frob", "blorp"))

    prompts = training_prompts(corpus=corpus, variants=2)
    assert len([p for p in prompts if "frobnicator" in p]) == 3  # its first framing and 2 more
    assert not set(vendored) & set(prompts)  # no framing of the held-out docstring
    assert not [p for p in prompts if "Vendored here: " in p]  # nor of its edited copy
    assert not set(CHAT_PROMPTS) & set(prompts)  # the chat prompts belong to the stdlib's list
    assert not [p for p in prompts if "snarknicator" in p]  # a corpus's tests are not docs
    assert [p for p in prompts if "blorpnicator" in p]  # the corpus's own folder name never counts
    (tmp_path / "empty" / "tests").mkdir(parents=True)
    (tmp_path / "empty" / "tests" / "rows.py").write_text((corpus / "tests" / "rows.py").read_text())
    with pytest.raises(DFlashError, match="no usable docstring in"):
        training_prompts(corpus=tmp_path / "empty")


def test_templated_chat_prompts_leave_out_the_topics_of_held_out_chat_prompts(monkeypatch):
    from dflash_local.train import chat_prompts
    from dflash_local.train.prompts import CHAT_PROMPTS, all_prompts, is_held_out

    prompts = chat_prompts.templated_chat_prompts()
    assert len(prompts) == len(set(prompts)) > 4000
    assert not set(prompts) & set(all_prompts())  # neither a training nor a held-out prompt again
    assert not [p for p in prompts if "food chain" in p]  # "How does a refrigerator keep food cold?"
    assert "What are tides?" in prompts and "What is tides?" not in prompts
    # a held-out chat prompt's subject under another template is dropped, also as a longer word
    held_out = next(p for p in CHAT_PROMPTS if is_held_out(p))
    subject = max(chat_prompts._content_words(held_out), key=len)
    topics = (f"the {subject} of it", f"{subject}ish ideas", "a crocodile and an alligator")
    monkeypatch.setattr(chat_prompts, "TEMPLATES_BY_KIND", ((("Tell me about {topic}.",), topics),))
    assert chat_prompts.templated_chat_prompts() == ["Tell me about a crocodile and an alligator."]


def test_templated_chat_prompts_only_grow_at_the_end():
    """A follow-up is chosen by its request's place in the list, and the shipped drafter's data
    holds follow-ups for the first 1,826 requests (step 11): those places must not move."""
    import hashlib

    from dflash_local.train.chat_prompts import templated_chat_prompts

    first = templated_chat_prompts()[:1826]
    digest = hashlib.sha256("\n".join(first).encode()).hexdigest()
    assert digest == "89a6e5cdec30d37732ebae4384d675bb2474cbdd87260039cfb24bf00dab2ad4"


def test_chat_prompts_are_what_a_chat_data_run_regenerates(target, tmp_path):
    from transformers import AutoTokenizer

    from dflash_local.train.chat_prompts import templated_chat_prompts
    from dflash_local.train.prompts import training_prompts
    from dflash_local.train.regenerate import done_prompts, encode_prompts

    data = tmp_path / "chat"
    assert main(["train", "--target", str(target), "--out", str(tmp_path / "d"), "--data", str(data),
                 "--chat-prompts", "--batch-size", "4", "--max-new-tokens", "3",
                 "--regen-minutes", "0.0001", "--steps", "0"]) == 0
    done, _ = done_prompts(data)
    tokenizer = AutoTokenizer.from_pretrained(target)
    chat = {tuple(ids) for ids in encode_prompts(tokenizer, templated_chat_prompts())}
    default_prompts = {tuple(ids) for ids in encode_prompts(tokenizer, training_prompts(limit=400))}
    assert done and done <= chat and not done & default_prompts  # one shard, all of it chat


def test_follow_ups_continue_the_targets_own_answers_to_chat_prompts(target, tmp_path, capsys):
    from transformers import AutoTokenizer

    from dflash_local.train.chat_prompts import FOLLOW_UPS
    from dflash_local.train.regenerate import (
        MAX_PROMPT_TOKENS,
        answers_in,
        done_prompts,
        encode_prompt,
        follow_up_prompts,
    )

    data = tmp_path / "chat"
    run = ["train", "--target", str(target), "--out", str(tmp_path / "d"), "--data", str(data),
           "--batch-size", "4", "--steps", "0", "--regen-minutes", "0.0001"]
    assert main([*run, "--chat-followups"]) == 2  # nothing to follow up yet
    assert "holds no answers to the --chat-prompts requests" in capsys.readouterr().err
    # answers long enough that request + answer + follow-up outgrow the first turn's prompt limit
    assert main([*run, "--chat-prompts", "--max-new-tokens", str(MAX_PROMPT_TOKENS)]) == 0
    first_turns = done_prompts(data)[0]
    assert main([*run, "--chat-followups", "--max-new-tokens", "3"]) == 0
    second_turns = done_prompts(data)[0] - first_turns
    tokenizer = AutoTokenizer.from_pretrained(target)
    conversations = follow_up_prompts(tokenizer, data)
    assert len(conversations) == len(first_turns)  # one follow-up per answered request
    assert second_turns and second_turns <= {tuple(encode_prompt(tokenizer, c)) for c in conversations}
    assert max(map(len, second_turns)) > MAX_PROMPT_TOKENS  # regenerated all the same
    answers = answers_in(data, first_turns)
    for request, answer, follow_up in conversations:
        first = encode_prompt(tokenizer, request["content"])
        assert answers[tuple(first)]  # the request's answer is in the data ...
        conversation = encode_prompt(tokenizer, [request, answer, follow_up])
        assert conversation[: len(first)] == first  # ... and the conversation goes on after it
        assert answer["role"] == "assistant" and answer["content"] and follow_up["content"] in FOLLOW_UPS


def test_a_requests_follow_up_does_not_depend_on_the_other_answers():
    from dflash_local.train.chat_prompts import follow_up_conversations, templated_chat_prompts

    requests = templated_chat_prompts()
    alone = follow_up_conversations({requests[7]: "An answer."})
    among = follow_up_conversations({requests[2]: "Another.", requests[7]: "An answer.", requests[9]: ""})
    assert alone == among[1:] and len(among) == 2  # an empty answer gets no follow-up


def test_follow_ups_name_no_subject_of_a_held_out_chat_prompt():
    from dflash_local.train import chat_prompts

    held_words = chat_prompts.held_out_words()
    subject = max(held_words, key=len)
    assert chat_prompts._shares_a_word(chat_prompts._content_words(f"And {subject}s?"), held_words)
    for follow_up in chat_prompts.FOLLOW_UPS:
        assert not chat_prompts._shares_a_word(chat_prompts._content_words(follow_up), held_words), follow_up


def test_the_validation_slice_is_chosen_by_prompt_not_by_position():
    from dflash_local.train.trainer import split_validation

    sequences = synthetic_sequences(400, 4)
    held, train_set = split_validation(sequences)
    assert len(held) == 8 and len(train_set) == 392
    assert not {id(s) for s in held} & {id(s) for s in train_set}
    positions = sorted(next(i for i, s in enumerate(sequences) if s is h) for h in held)
    assert positions != list(range(8))  # not simply the first sequences (the first shard)
    grown, _ = split_validation(sequences + synthetic_sequences(100, 4, seed=1))
    assert len({id(s) for s in grown} & {id(s) for s in held}) >= 5  # mostly the same slice


def test_negative_prompt_variants_are_refused():
    from dflash_local.train.prompts import training_prompts

    with pytest.raises(DFlashError, match="prompt variants must be >= 0"):
        training_prompts(limit=10, variants=-1)


def test_the_schedule_is_fitted_to_the_pace_after_the_slow_first_steps():
    from dflash_local.train.trainer import StepBudget

    now = [0.0]
    budget = StepBudget(minutes=10, clock=lambda: now[0])
    totals = []
    for step in range(1, 40):
        now[0] += 3.0 if step <= 5 else 0.5  # warm-up steps take 3 s, then 0.5 s each
        totals.append(budget.total_after_step(step))
    fitted = next(total for total in totals if total is not None)
    measured_at = totals.index(fitted) + 1
    assert measured_at == StepBudget.SKIP + StepBudget.MEASURE
    # the rest of the 600 s budget at 0.5 s a step; fitting on the first five would give 200 steps
    elapsed = 5 * 3.0 + (measured_at - 5) * 0.5
    assert fitted == measured_at + int((600 - elapsed) / 0.5)


def test_regenerated_responses_end_where_served_ones_do():
    """One list of end-of-turn ids (engines.chat_prompt.end_of_turn_ids) for serving and regeneration:
    a Gemma-style template's <end_of_turn>, never a None for markers the tokenizer lacks."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from dflash_local.engines.chat_prompt import end_of_turn_ids

    vocab = {"<eos>": 0, "<end_of_turn>": 1, "hello": 2}
    gemma_like = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab)),
                                         eos_token="<eos>")  # no unknown token, no <|im_end|>
    assert end_of_turn_ids(gemma_like) == [0, 1]
