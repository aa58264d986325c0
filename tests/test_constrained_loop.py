"""Constrained speculative decoding equals constrained plain decoding, token for token (greedy),
on both local engines (tiny random Qwen3 / Llama targets with z-lab-format drafters): chains,
trees, prompt lookup, scripted partial acceptance; every finished reply parses and validates.
The oracle is constraint_oracle.py's naive loop, not the loop's Guide.

Random drafters are rarely right, so scripted drafters that propose the oracle's output (right
for the first k drafts of a block, wrong after) force the paths a grammar changes: wrong drafts
the grammar forbids are pruned before the verify, right ones are kept.
"""

from __future__ import annotations

import numpy as np
import pytest
from constraint_oracle import ANSWER, constrained_plain, follows_answer_schema
from fixtures_tiny import (
    ReferenceDrafter,
    ScriptedDrafter,
    collect,
    follow,
    params_of,
    tiny_engine,
    tiny_pair,
    use_policy,
)
from test_lookup import COSTS

from dflash_local.drafter.model_torch import DraftSession
from dflash_local.errors import InvalidRequestError
from dflash_local.events import OutputConstraint
from dflash_local.method import speculative
from dflash_local.method.constraint import DEAD_END, Guide
from dflash_local.method.planning.modes import LOOKUP
from dflash_local.method.planning.widths import BlockPolicy

PROMPTS = ["Is it raining? Answer in JSON.", "count the words: a b c"]
MAX_TOKENS = 64


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def engine(request, tmp_path_factory):
    return tiny_engine(tiny_pair(tmp_path_factory, request.param))


@pytest.fixture(scope="module")
def oracle_runs(engine):
    runs = {}
    for text in PROMPTS:
        prompt_ids = engine.encode_chat([{"role": "user", "content": text}])
        runs[text] = (prompt_ids, constrained_plain(engine, prompt_ids, ANSWER, MAX_TOKENS))
    return runs


def run(engine, prompt_ids, **params):
    return collect(engine.stream(prompt_ids, params_of(max_tokens=MAX_TOKENS, constraint=ANSWER,
                                                       **params)))


def check_reply(engine, tokens, events):
    assert events[-1].finish_reason == "stop", "a bounded schema finishes within max_tokens"
    assert follows_answer_schema(engine.decode(tokens)), engine.decode(tokens)


def test_constrained_plain_is_the_oracle(engine, oracle_runs):
    for prompt_ids, expected in oracle_runs.values():
        tokens, events = run(engine, prompt_ids, speculative=False)
        assert tokens == expected
        check_reply(engine, tokens, events)


@pytest.mark.parametrize("block_size", [2, 4, 16, "auto"])
@pytest.mark.parametrize("tree", [True, False], ids=["tree", "chain"])
def test_constrained_speculative_equals_constrained_plain(engine, oracle_runs, block_size, tree):
    for prompt_ids, expected in oracle_runs.values():
        tokens, events = run(engine, prompt_ids, block_size=block_size, tree=tree)
        assert tokens == expected
        check_reply(engine, tokens, events)


def test_forced_tokens_are_a_free_draft(engine, oracle_runs):
    """A random drafter keeps next to nothing; the schema's punctuation and keys are forced,
    grafted on as drafts and kept: fewer rounds than tokens. Plain decoding grafts none."""
    prompt_ids, expected = oracle_runs[PROMPTS[0]]
    tokens, events = run(engine, prompt_ids, block_size=16)
    assert tokens == expected
    assert sum(event.accepted for event in events) >= len('{"answer": "') - 1
    assert len(events) < len(tokens) / 2
    _, plain_events = run(engine, prompt_ids, speculative=False)
    assert len(plain_events) == len(expected)


@pytest.mark.parametrize("right", [None, 0, 2], ids=["all-right", "all-wrong", "two-right"])
def test_scripted_drafts_pruned_and_kept(engine, oracle_runs, monkeypatch, right):
    prompt_ids, expected = oracle_runs[PROMPTS[1]]
    script = follow(expected, len(prompt_ids), right=right)
    monkeypatch.setattr(engine, "make_drafter", lambda window=None: ScriptedDrafter(
        prompt_ids, script, drafter_block=16, inner=DraftSession(engine.drafter, window=window)))
    tokens, events = run(engine, prompt_ids, block_size=8, tree=False)
    assert tokens == expected
    if right is None:  # every draft right: rounds commit whole blocks
        assert max(event.accepted for event in events) >= 7


def test_prompt_lookup_rounds_stay_exact(engine, monkeypatch):
    """Lookup rounds taken (test_lookup.py's policy, a drafter always wrong) on a prompt whose
    JSON the reply can copy: a lookup chain is pruned and masked as any draft is."""
    reply = '{"answer": "no", "count": 7, "word": "abc"}'
    prompt_ids = engine.encode_chat([{"role": "user", "content": f"Repeat: {reply} {reply}"}])
    expected = constrained_plain(engine, prompt_ids, ANSWER, MAX_TOKENS)
    use_policy(monkeypatch, lambda width, whole: BlockPolicy(
        COSTS, [0.5] * 15, max_width=width, whole_block_drafts=whole))
    real = type(engine).make_drafter.__get__(engine)
    monkeypatch.setattr(engine, "make_drafter", lambda window=None: ReferenceDrafter(
        real(window), len(prompt_ids), expected, right=lambda index, offset: False))
    tokens, events = run(engine, prompt_ids, block_size="auto", prompt_lookup=True)
    assert tokens == expected
    assert LOOKUP in {event.mode for event in events[1:]}


def test_max_tokens_cuts_a_reply_with_length(engine, oracle_runs):
    prompt_ids, expected = oracle_runs[PROMPTS[0]]
    tokens, events = collect(engine.stream(prompt_ids, params_of(max_tokens=9, constraint=ANSWER,
                                                                 block_size=16)))
    assert tokens == expected[:9]
    assert events[-1].finish_reason == "length"


@pytest.mark.parametrize("constraint", [OutputConstraint("regex", "a(b"),
                                        OutputConstraint("json_schema", '{"type": "objekt"}')])
def test_a_bad_constraint_is_refused_before_generating(engine, constraint):
    prompt_ids = engine.encode_chat([{"role": "user", "content": "hi"}])
    with pytest.raises(InvalidRequestError, match="constraint: "):
        next(engine.stream(prompt_ids, params_of(max_tokens=4, constraint=constraint)))


def test_regex_and_lark_constraints_hold(engine):
    prompt_ids = engine.encode_chat([{"role": "user", "content": "a date"}])
    for constraint, check in [
            (OutputConstraint("regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
             lambda text: len(text) == 10 and text[4] == text[7] == "-"),
            (OutputConstraint("lark", 'start: "(" item (", " item)* ")"\nitem: /[a-c]{1,3}/'),
             lambda text: text.startswith("(") and text.endswith(")"))]:
        expected = constrained_plain(engine, prompt_ids, constraint, 40)
        tokens, events = collect(engine.stream(prompt_ids, params_of(
            max_tokens=40, constraint=constraint, block_size=16)))
        assert tokens == expected
        if events[-1].finish_reason == "stop":
            assert check(engine.decode(tokens)), engine.decode(tokens)


class DeadEndGrammar:
    """Admits one token, then nothing, and is never a whole match: a grammar a real engine
    reaches only on a limit hit mid-reply (a scripted fake: no real grammar does it on demand)."""

    def __init__(self, token_id: int, vocab: int):
        self.token_id, self.vocab, self.consumed = token_id, vocab, 0
        self.busy_s = 0.0

    def allowed(self):
        allowed = np.zeros(self.vocab, dtype=bool)
        allowed[self.token_id] = self.consumed == 0
        return allowed

    def complete(self):
        return False

    def consume(self, token_id):
        self.consumed += 1

    def rollback(self, count):
        self.consumed -= count

    def forced(self):
        return [self.token_id] if self.consumed == 0 else []


@pytest.mark.parametrize("block_size", [1, 16])
def test_a_grammar_that_admits_nothing_ends_the_reply(engine, block_size):
    prompt_ids = engine.encode_chat([{"role": "user", "content": "hi"}])
    params = params_of(max_tokens=20, block_size=block_size, speculative=block_size > 1,
                       stop_token_ids=tuple(engine.eos_token_ids))
    drafter = engine.make_drafter() if block_size > 1 else None
    events = list(speculative.generate(engine.make_runner(collect_taps=drafter is not None),
                                       drafter, prompt_ids, params,
                                       grammar=DeadEndGrammar(65, 260)))
    tokens = [token for event in events for token in event.token_ids]
    assert tokens[0] == 65 and tokens[1] in engine.eos_token_ids and len(tokens) == 2
    assert events[-1].finish_reason == DEAD_END


def test_a_guide_needs_a_stop_token():
    with pytest.raises(InvalidRequestError, match="stop token"):
        Guide(DeadEndGrammar(1, 4), (), free_draft=0, max_tokens=4)


def test_a_negative_stop_id_is_no_stop_token():
    with pytest.raises(InvalidRequestError, match="stop token"):
        Guide(DeadEndGrammar(1, 4), (-1,), free_draft=0, max_tokens=4)


def test_a_kept_prefix_serves_a_constrained_reply_unchanged(engine, oracle_runs):
    prompt_ids, expected = oracle_runs[PROMPTS[0]]
    run(engine, prompt_ids, block_size=4)  # keeps this conversation's state
    tokens, events = run(engine, prompt_ids, block_size=4)
    assert events[0].cached_tokens > 0
    assert tokens == expected


class FixedGrammar(DeadEndGrammar):
    """Admits the same tokens at every step and is never a whole match."""

    def __init__(self, allowed: np.ndarray):
        super().__init__(0, len(allowed))
        self.mask = allowed

    def allowed(self):
        return self.mask.copy()


@pytest.mark.parametrize("admitted_share", [0.02, 0.9], ids=["few-admitted", "most-admitted"])
@pytest.mark.parametrize("grammar_vocab", [250, 260, 270])  # narrower, as wide, wider than logits
def test_a_row_mask_is_the_naive_where(admitted_share, grammar_vocab):
    """Guide.mask writes each row through an index list; the naive np.where is its oracle."""
    rng = np.random.default_rng(grammar_vocab)
    allowed = rng.random(grammar_vocab) < admitted_share
    logits = rng.standard_normal((1, 260)).astype(np.float32)
    expected_allowed = np.zeros(260, dtype=bool)
    width = min(grammar_vocab, 260)
    expected_allowed[:width] = allowed[:width]
    expected_allowed[3] = False  # the stop token, where the text is not a whole match
    masked = Guide(FixedGrammar(allowed), (3,), free_draft=0, max_tokens=4).mask(logits.copy())
    assert masked.dtype == logits.dtype
    assert np.array_equal(masked, np.where(expected_allowed, logits, -np.inf))
