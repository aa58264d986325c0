"""The exact sampling rule, checked statistically, and the top-k / top-p filters.

A statistical check is only worth something if a wrong rule fails it, so each check also runs on
a deliberately wrong rule and must reject it. Seeds are fixed: the outcome is deterministic.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from fixtures_tiny import ScriptedDrafter, tiny_engine, tiny_pair

from dflash_local import speculative
from dflash_local.acceptance import sample_from, sampled_accept, target_probs
from dflash_local.events import GenerationParams


def sample_params(**kwargs) -> GenerationParams:
    return GenerationParams(temperature=kwargs.pop("temperature", 1.0), **kwargs)


# --- filters ---

def test_temperature_only_is_softmax():
    logits = np.array([[1.0, 3.0, 2.0, 0.0]])
    for temperature in (0.5, 1.0, 2.0):
        expected = np.exp(logits / temperature) / np.exp(logits / temperature).sum()
        probs = target_probs(logits, sample_params(temperature=temperature))
        np.testing.assert_allclose(probs, expected)


def test_top_k_keeps_the_k_largest():
    logits = np.array([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 4.0]])
    probs = target_probs(logits, sample_params(top_k=2))
    np.testing.assert_allclose(probs[0], [0, math.e / (1 + math.e), 1 / (1 + math.e), 0])
    np.testing.assert_allclose(probs[1], [0, 0, math.e / (1 + math.e), 1 / (1 + math.e)])
    for top_k in (0, 4, 10):  # 0 = off, k >= V = nothing to cut
        np.testing.assert_allclose(target_probs(logits, sample_params(top_k=top_k)),
                                   target_probs(logits, sample_params()))


@pytest.mark.parametrize("top_p, expected", [
    (0.4, [1.0, 0, 0, 0]),  # the first token already reaches 0.4
    (0.7, [0.625, 0.375, 0, 0]),  # the token crossing top_p is kept
    (0.9, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
    (1.0, [0.5, 0.3, 0.15, 0.05]),
])
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p, expected):
    logits = np.log(np.array([[0.15, 0.5, 0.05, 0.3]]))
    order = [1, 3, 0, 2]  # tokens by probability
    probs = target_probs(logits, sample_params(top_p=top_p))[0]
    np.testing.assert_allclose(probs[order], expected, atol=1e-12)


def test_filters_match_zlab_reference():
    zlab = pytest.importorskip("dflash.model")  # test-only oracle
    logits = np.random.default_rng(0).normal(0, 2, size=(5, 50))
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 10, 0.5)]:
        params = sample_params(temperature=temperature, top_k=top_k, top_p=top_p)
        expected = zlab._sampling_probs(torch.tensor(logits), temperature, top_p, top_k).numpy()
        # theirs computes in float32
        np.testing.assert_allclose(target_probs(logits, params), expected, atol=1e-6)


# --- the acceptance rule, on synthetic distributions ---

def accept_always(draft_ids, probs, rng):
    """Wrong: keeps every draft."""
    return len(draft_ids), sample_from(probs[len(draft_ids)], rng)


def resample_from_p(draft_ids, probs, rng):
    """Wrong: on rejection samples from p itself, not from p without the draft renormalised."""
    for row, draft_id in enumerate(draft_ids):
        if rng.random() >= probs[row, draft_id]:
            return row, sample_from(probs[row], rng)
    return len(draft_ids), sample_from(probs[len(draft_ids)], rng)


def emitted(rule, draft_ids, probs, seeds: int) -> list[list[int]]:
    """The tokens each seed's round emits: accepted drafts, then the next token."""
    out = []
    for seed in range(seeds):
        accepted_len, next_id = rule(draft_ids, probs, np.random.default_rng(seed))
        out.append([*draft_ids[:accepted_len], next_id])
    return out


def total_variation(samples: list[int], p: np.ndarray) -> float:
    frequencies = np.bincount(samples, minlength=len(p)) / len(samples)
    return 0.5 * float(np.abs(frequencies - p).sum())


# 20,000 draws over 6 tokens: a right rule lands at TV ~0.006; 0.02 is ~3x that, and the wrong
# rules miss by (1 - p_d) * p_d >= 0.05 on every case below
SEEDS, TOLERANCE = 20_000, 0.02
ROWS = np.array([
    [0.05, 0.55, 0.20, 0.10, 0.05, 0.05],
    [0.30, 0.10, 0.25, 0.25, 0.05, 0.05],
    [0.10, 0.10, 0.10, 0.10, 0.10, 0.50],
])


@pytest.mark.parametrize("draft_ids", [[1, 2], [4, 0], [2, 3]], ids=["likely", "unlikely", "mid"])
def test_first_token_follows_p(draft_ids):
    tokens = emitted(sampled_accept, draft_ids, ROWS, SEEDS)
    assert total_variation([t[0] for t in tokens], ROWS[0]) < TOLERANCE
    for wrong in (accept_always, resample_from_p):
        wrong_tokens = emitted(wrong, draft_ids, ROWS, SEEDS)
        assert total_variation([t[0] for t in wrong_tokens], ROWS[0]) > TOLERANCE, wrong.__name__


def test_second_token_follows_p_after_an_accepted_first():
    draft_ids = [1, 2]
    seconds = [t[1] for t in emitted(sampled_accept, draft_ids, ROWS, SEEDS) if len(t) > 1]
    assert total_variation(seconds, ROWS[1]) < TOLERANCE * 1.5  # ~11,000 draws here
    wrong = [t[1] for t in emitted(resample_from_p, draft_ids, ROWS, SEEDS) if len(t) > 1]
    assert total_variation(wrong, ROWS[1]) > TOLERANCE * 1.5


def test_a_draft_outside_the_filtered_support_is_always_rejected():
    probs = np.array([[0.0, 0.7, 0.3], [0.2, 0.3, 0.5]])
    for seed in range(50):
        accepted_len, next_id = sampled_accept([0], probs, np.random.default_rng(seed))
        assert accepted_len == 0 and next_id in (1, 2)


# --- end to end: the first tokens of speculative.generate on a tiny target ---

PROMPT_TEXT = "hello world"
MAX_TOKENS, MEASURED = 4, 3  # round 1 drafts 2 tokens; the first 3 emitted tokens are compared


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return tiny_engine(tiny_pair(tmp_path_factory, "qwen3"))


def exact_joint(engine, prompt_ids, params) -> tuple[dict, dict]:
    """P(first MEASURED tokens) under plain sampling, from the target's own filtered probabilities;
    and the conditional tables {generated prefix: probs} the scripted drafter reads."""
    tables: dict[tuple, np.ndarray] = {}
    joint = {(): 1.0}
    for _ in range(MEASURED):
        extended = {}
        for prefix, mass in joint.items():
            probs = next_probs(engine, prompt_ids + list(prefix), params)
            tables[prefix] = probs
            for token in np.flatnonzero(probs):
                extended[(*prefix, int(token))] = mass * probs[token]
        joint = extended
    return joint, tables


def next_probs(engine, ids, params) -> np.ndarray:
    with torch.inference_mode():
        logits = engine.model(torch.tensor([ids])).logits[0, -1:].float().numpy()
    return target_probs(logits, params)[0]


def greedy_script(prompt_len: int, tables: dict):
    """Proposes the target's most likely tokens: accepted often, so the rule is really exercised."""

    def script(sequence, count):
        prefix, drafts = tuple(sequence[prompt_len:]), []
        for _ in range(count):
            probs = tables.get(prefix)
            drafts.append(int(np.argmax(probs)) if probs is not None else 0)
            prefix = (*prefix, drafts[-1])
        return drafts

    return script


def sample_runs(engine, prompt_ids, params, tables, seeds, speculate=True) -> list[tuple]:
    firsts = []
    for seed in range(seeds):
        seeded = GenerationParams(**{**params.__dict__, "seed": seed, "max_tokens": MAX_TOKENS,
                                     "stop_token_ids": (10_000,)})
        drafter = (ScriptedDrafter(prompt_ids, greedy_script(len(prompt_ids), tables), block_size=4)
                   if speculate else None)
        runner = engine.make_runner(collect_taps=speculate)
        events = speculative.generate(runner, drafter, prompt_ids, seeded)
        tokens = [token for event in events for token in event.token_ids]
        firsts.append(tuple(tokens[:MEASURED]))
    return firsts


def chi_square_p_value(samples: list[tuple], joint: dict) -> float:
    """Goodness of fit to the exact joint; cells expected < 5 are pooled. Wilson-Hilferty
    turns the statistic into a p-value (no scipy here), accurate to ~1e-3 at these df."""
    n = len(samples)
    counts: dict[tuple, int] = {}
    for sample in samples:
        assert sample in joint, f"{sample} has probability 0 under the target"
        counts[sample] = counts.get(sample, 0) + 1
    big = [cell for cell, p in joint.items() if p * n >= 5]
    bins = [(counts.get(cell, 0), joint[cell] * n) for cell in big]
    rest = n - sum(observed for observed, _ in bins), n - sum(expected for _, expected in bins)
    bins.append(rest)
    stat = sum((observed - expected) ** 2 / expected for observed, expected in bins if expected > 0)
    df = len(bins) - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


# p > 1e-3 passes: a right sampler fails that for 0.1% of seed sets (ours are fixed); the
# accept-always rule below lands under 1e-12
PASS_P_VALUE = 1e-3


@pytest.mark.parametrize("filters", [{"top_k": 3}, {"top_k": 6, "top_p": 0.6}],
                         ids=["top_k", "top_k+top_p"])
def test_speculative_first_tokens_follow_plain_sampling(engine, filters):
    prompt_ids = engine.encode_chat([{"role": "user", "content": PROMPT_TEXT}])
    params = sample_params(**filters)
    joint, tables = exact_joint(engine, prompt_ids, params)
    speculated = sample_runs(engine, prompt_ids, params, tables, seeds=300)
    assert chi_square_p_value(speculated, joint) > PASS_P_VALUE


def test_plain_sampling_and_a_wrong_rule_against_the_same_check(engine, monkeypatch):
    prompt_ids = engine.encode_chat([{"role": "user", "content": PROMPT_TEXT}])
    params = sample_params(top_k=3)
    joint, tables = exact_joint(engine, prompt_ids, params)
    plain = sample_runs(engine, prompt_ids, params, tables, seeds=300, speculate=False)
    assert chi_square_p_value(plain, joint) > PASS_P_VALUE

    monkeypatch.setattr(speculative, "sampled_accept", accept_always)
    wrong = sample_runs(engine, prompt_ids, params, tables, seeds=150)
    assert chi_square_p_value(wrong, joint) < 1e-6
