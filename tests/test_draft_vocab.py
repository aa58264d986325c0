"""The draft vocabulary: drafting scores only the target outputs a drafter's data used.

Checked against a naive oracle (the full head's logits, masked to the set, argmax), for the
kinds of head a target has (plain, oneDNN-packed, tied, biased; MLX tied, quantized, biased), through both
engines (speculative still equals plain; MLX and Transformers agree round for round), and the
file's bad inputs.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections import Counter

import numpy as np
import pytest
import torch
from fixtures_tiny import collect, tiny_pair
from tiny_models import VOCAB

from dflash_local.accel.torch_linear import PackedLinear, packing_available
from dflash_local.drafter import model_torch
from dflash_local.drafter.draft_vocab import (
    FILE_NAME,
    choose_draft_vocab,
    count_tokens,
    load_draft_vocab,
    write_draft_vocab,
)
from dflash_local.errors import CheckpointError
from dflash_local.events import GenerationParams, parse_block_size
from dflash_local.method import calibration

HIDDEN = 64
SUBSET = sorted(np.random.default_rng(7).choice(VOCAB, size=40, replace=False).tolist())


def test_choose_keeps_the_most_frequent_ids_ascending_ties_to_the_lower_id():
    counts = count_tokens([[5, 5, 5, 9, 9, 2], [9, 7, 7, 1]])
    assert counts == Counter({5: 3, 9: 3, 7: 2, 2: 1, 1: 1})
    assert choose_draft_vocab(counts, 3) == [5, 7, 9]
    assert choose_draft_vocab(counts, 4) == [1, 5, 7, 9]  # 1 and 2 tie: the lower id
    assert choose_draft_vocab(counts, 100) == [1, 2, 5, 7, 9]


def test_the_file_round_trips_with_its_coverage(tmp_path):
    counts = Counter({3: 6, 4: 3, 8: 1})
    write_draft_vocab(tmp_path, [4, 3], counts)
    record = json.loads((tmp_path / FILE_NAME).read_text())
    assert record["coverage"] == 0.9 and record["counted_tokens"] == 10
    assert load_draft_vocab(tmp_path, vocab_size=10) == [3, 4]
    assert load_draft_vocab(tmp_path / "nowhere", vocab_size=10) is None
    assert load_draft_vocab(None, vocab_size=10) is None


@pytest.mark.parametrize("content, message", [
    ("{not json", "is not a draft vocabulary"),
    ('{"ids": [1, 2]}', "is not a draft vocabulary"),
    ('{"token_ids": []}', "non-empty list of integers"),
    ('{"token_ids": [1, "2"]}', "non-empty list of integers"),
    ('{"token_ids": [1, 2, 2]}', "duplicates"),
    ('{"token_ids": [1, 10]}', "outside the target's vocabulary of 10"),
])
def test_a_bad_file_is_a_checkpoint_error_that_says_what_is_wrong(tmp_path, content, message):
    (tmp_path / FILE_NAME).write_text(content)
    with pytest.raises(CheckpointError, match=message):
        load_draft_vocab(tmp_path, vocab_size=10)


def _drafter(tmp_path_factory, head):
    pair = tiny_pair(tmp_path_factory)
    drafter = model_torch.load_drafter(pair.drafter)
    embed = torch.nn.Embedding(VOCAB, HIDDEN)
    return drafter.bind(embed, head)


def _heads():
    torch.manual_seed(0)
    plain = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    biased = torch.nn.Linear(HIDDEN, VOCAB, bias=True)
    tied = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    tied.weight = torch.nn.Embedding(VOCAB, HIDDEN).weight  # the embedding table is the head
    heads = {"plain": plain, "biased": biased, "tied": tied}
    if packing_available():
        heads["packed"] = PackedLinear(torch.nn.Linear(HIDDEN, VOCAB, bias=False), rows_hint=16)
    return heads


@pytest.mark.parametrize("kind", sorted(_heads()))
def test_torch_proposals_are_the_argmax_over_the_set_for_every_kind_of_head(tmp_path_factory, kind):
    head = _heads()[kind]
    drafter = _drafter(tmp_path_factory, head)
    hidden = torch.randn(1, 15, HIDDEN) * 3
    with torch.no_grad():
        full = drafter.logits(hidden)
        masked = torch.full_like(full, float("-inf"))
        masked[..., SUBSET] = full[..., SUBSET]
        expected = masked.argmax(-1)
        unrestricted = drafter.draft_token_ids(hidden)
        drafter.restrict_draft_vocab(SUBSET)
        got = drafter.draft_token_ids(hidden)
    assert torch.equal(unrestricted, full.argmax(-1))
    assert torch.equal(got, expected)
    assert set(got.flatten().tolist()) <= set(SUBSET)
    assert not torch.equal(got, unrestricted)  # the set changes proposals here: not vacuous
    restricted_head = drafter._draft_head[0]
    assert restricted_head.out_features == len(SUBSET)
    assert (restricted_head.bias is not None) == (kind == "biased")


@pytest.mark.parametrize("kind", ["plain", "biased", "tied"])
def test_the_restricted_rows_are_the_heads_own_rows_exactly(tmp_path_factory, kind):
    head = _heads()[kind]
    drafter = _drafter(tmp_path_factory, head)
    drafter.restrict_draft_vocab(SUBSET)
    restricted = drafter._draft_head[0]
    assert torch.equal(restricted.weight, head.weight[SUBSET])
    if kind == "biased":
        assert torch.equal(restricted.bias, head.bias[SUBSET])


@pytest.mark.skipif(not packing_available(), reason="oneDNN packing unavailable")
def test_a_packed_heads_rows_come_out_exact_through_unit_vectors(tmp_path_factory):
    torch.manual_seed(2)
    linear = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    drafter = _drafter(tmp_path_factory, PackedLinear(linear, rows_hint=16))
    drafter.restrict_draft_vocab(SUBSET)
    assert torch.equal(drafter._draft_head[0].weight, linear.weight[SUBSET])


def _with_vocab(tmp_path, pair, token_ids):
    """A copy of the pair's drafter directory with a draft_vocab.json."""
    drafter = tmp_path / "drafter"
    shutil.copytree(pair.drafter, drafter)
    write_draft_vocab(drafter, token_ids, Counter(token_ids))
    return drafter


def test_the_torch_engine_drafts_from_the_set_and_stays_lossless(tmp_path, tmp_path_factory):
    from dflash_local.engines.torch_engine import TorchEngine

    pair = tiny_pair(tmp_path_factory)
    full = TorchEngine(pair.target, pair.drafter)
    restricted = TorchEngine(pair.target, _with_vocab(tmp_path, pair, SUBSET))
    off = TorchEngine(pair.target, _with_vocab(tmp_path / "off", pair, SUBSET), draft_vocab=False)
    assert (full.pair.draft_vocab_size, restricted.pair.draft_vocab_size, off.pair.draft_vocab_size) == (
        None, len(SUBSET), None)
    assert calibration.calibration_key(restricted.pair, restricted.compute_threads())["draft_vocab"] == len(SUBSET)
    if packing_available():
        assert isinstance(restricted.drafter._draft_head[0], PackedLinear)
    session = restricted.make_drafter()
    proposals = session.propose(5, torch.randn(1, 4, session.model.fc.in_features), 16)
    assert set(proposals) <= set(SUBSET)
    prompt = restricted.encode_chat([{"role": "user", "content": "count to ten"}])
    expected, _ = collect(full.stream(prompt, GenerationParams(max_tokens=24, speculative=False,
                                                                stop_token_ids=(10_000,))))
    for block_size in (2, 8, 16):
        tokens, _ = collect(restricted.stream(prompt, GenerationParams(
            max_tokens=24, block_size=parse_block_size(block_size), stop_token_ids=(10_000,))))
        assert tokens == expected, block_size


def test_a_corrupt_draft_vocabulary_fails_the_load_before_the_target_loads(tmp_path, tmp_path_factory, monkeypatch):
    from dflash_local.engines import torch_engine

    pair = tiny_pair(tmp_path_factory)
    drafter = _with_vocab(tmp_path, pair, SUBSET)
    (drafter / FILE_NAME).write_text('{"token_ids": [1, 99999]}')
    monkeypatch.setattr(torch_engine, "_load_target", lambda *a: pytest.fail("target loaded first"))
    with pytest.raises(CheckpointError, match="outside the target's vocabulary"):
        torch_engine.TorchEngine(pair.target, drafter)


mlx_needed = pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="mlx missing")


@mlx_needed
def test_mlx_proposals_are_the_argmax_over_the_set_for_tied_quantized_and_biased_heads(tmp_path_factory):
    import mlx.core as mx
    from mlx import nn

    from dflash_local.drafter import model_mlx

    rng = np.random.default_rng(3)
    embed = nn.Embedding(VOCAB, HIDDEN)
    embed.weight = mx.array(rng.normal(0, 0.5, (VOCAB, HIDDEN)).astype(np.float32))
    quantized = nn.QuantizedLinear.from_linear(nn.Linear(HIDDEN, VOCAB, bias=False), group_size=32, bits=4)
    biased = nn.Linear(HIDDEN, VOCAB, bias=True)
    hidden = mx.array(rng.normal(0, 3, (1, 15, HIDDEN)).astype(np.float32))
    subset = mx.array(SUBSET)
    drafter = model_mlx.load_drafter(tiny_pair(tmp_path_factory).drafter)
    for name, head in (("tied", embed.as_linear), ("quantized", quantized), ("biased", biased)):
        drafter.bind(embed, head)
        drafter.draft_head = None
        full = drafter.logits(hidden)
        expected = mx.take(subset, mx.argmax(mx.take(full, subset, axis=-1), axis=-1))
        drafter.restrict_draft_vocab(SUBSET)
        got = drafter.draft_token_ids(hidden)
        assert mx.array_equal(got, expected).item(), name
        assert (drafter.draft_head.bias is not None) == (name == "biased"), name
        assert not mx.array_equal(got, mx.argmax(full, axis=-1)).item(), name  # the set matters


@mlx_needed
def test_mlx_and_transformers_engines_agree_round_for_round_with_a_set(tmp_path, tmp_path_factory):
    from dflash_local.engines.mlx_engine import MLXEngine
    from dflash_local.engines.torch_engine import TorchEngine

    pair = tiny_pair(tmp_path_factory)
    plain_engine = TorchEngine(pair.target, None)
    prompt = plain_engine.encode_chat([{"role": "user", "content": "abc abc abc"}])
    params = GenerationParams(max_tokens=24, block_size=parse_block_size(8), stop_token_ids=(10_000,))
    plain, _ = collect(plain_engine.stream(prompt, GenerationParams(max_tokens=24, speculative=False,
                                                                     stop_token_ids=(10_000,))))
    # a set of the output's two most frequent ids: the drafter can only propose those, so some
    # drafts are right and both engines must accept exactly the same ones
    common = [token for token, _ in Counter(plain).most_common(2)]
    drafter = _with_vocab(tmp_path, pair, common)
    engines = MLXEngine(pair.target, drafter), TorchEngine(pair.target, drafter)
    assert [e.pair.draft_vocab_size for e in engines] == [2, 2]
    runs = []
    for engine in engines:
        tokens, events = collect(engine.stream(prompt, params))
        runs.append((tokens, [e.accepted for e in events]))
    assert runs[0] == runs[1]
    assert runs[0][0] == plain and any(runs[0][1])  # lossless, and some drafts were accepted
    mlx_session, torch_session = engines[0].make_drafter(), engines[1].make_drafter()
    taps = np.random.default_rng(1).normal(0, 1, (1, 5, torch_session.model.fc.in_features)).astype(np.float32)
    import mlx.core as mx

    proposals = mlx_session.propose(7, mx.array(taps), 16)
    assert proposals == torch_session.propose(7, torch.from_numpy(taps), 16)
    assert set(proposals) <= set(common)
