"""Prompt lookup as a second proposal source: the n-gram index, the policy that prices lookup
rounds, and the real loop on tiny pairs (Transformers and MLX): token for token the plain
output, with lookup rounds taken when copying pays and not taken when it does not."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from fixtures_tiny import ReferenceDrafter, collect, tiny_engine, tiny_pair, use_policy

from dflash_local.events import GenerationParams, parse_block_size
from dflash_local.method.lookup import NgramIndex
from dflash_local.method.planning.costs import RoundCosts
from dflash_local.method.planning.lookups import LookupPolicy
from dflash_local.method.planning.modes import LOOKUP
from dflash_local.method.planning.widths import BlockPolicy

# the shape measured here with torch on the CPU: a verify of 2 rows costs 1.3 plain steps, of 16
# rows 2.0; a drafter pass costs as much as a plain step
VERIFY = (1.0, *(1.3 + 0.05 * (w - 2) for w in range(2, 17)))
COSTS = RoundCosts(tuple([VERIFY[0]] + [v + 1.0 for v in VERIFY[1:]]), VERIFY)


def test_index_proposes_what_followed_the_latest_longest_match():
    index = NgramIndex([5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7], max_ngram=3)
    draft = index.propose(4)
    assert draft.token_ids == (9, 2, 6, 7) and draft.ngram == 2  # latest "6 7" -> 9, not 8
    index.extend([9])
    assert index.propose(3).token_ids == (2, 6, 7) and index.propose(3).ngram == 3  # "6 7 9"
    assert index.propose(1).token_ids == (2,)


def test_a_copy_reaching_the_end_of_the_text_goes_on_with_its_own_tokens():
    """Periodic text (period shorter than the draft) is proposed as far as asked."""
    index = NgramIndex([7, 1, 2, 3, 1, 2, 3])
    draft = index.propose(5)
    assert draft.token_ids == (1, 2, 3, 1, 2) and draft.ngram == 3
    assert NgramIndex([9, 5, 5, 5]).propose(4).token_ids == (5, 5, 5, 5)
    assert NgramIndex([1, 2, 3, 1]).propose(2).token_ids == (2, 3)  # no overlap needed: as before


def test_index_never_proposes_from_the_suffix_itself_or_without_a_match():
    assert NgramIndex([1, 2, 3]).propose(4) is None  # every token new: nothing to copy
    assert NgramIndex([]).propose(4) is None
    index = NgramIndex([4, 4])
    assert index.propose(3).token_ids == (4, 4, 4)  # the earlier 4 is followed by the last one, on
    assert index.propose(0) is None
    with pytest.raises(ValueError):
        NgramIndex([1], max_ngram=0)


def test_lookup_policy_widens_within_a_few_rounds_and_stops_after_rejections():
    policy = LookupPolicy(COSTS, max_ngram=3)

    def round_of(ngram: int, accepted_of_width=None) -> int:
        """One round as the loop runs it: forget a little, plan, then report what was kept."""
        policy.next_round()
        width, _ = policy.plan(ngram, draft_len=15, limit=16)
        if accepted_of_width is not None:
            policy.observe(ngram, width, accepted_of_width(width))
        return width

    assert policy.plan(1, 15, 16)[0] < policy.plan(3, 15, 16)[0]  # a longer match is surer
    widths = [round_of(2, lambda w: w - 1) for _ in range(4)]  # a long copy: every draft kept
    assert widths[0] <= 8 and widths[-1] == 16 and widths == sorted(widths)
    assert policy.plan(2, draft_len=4, limit=16)[0] == 5  # never wider than the draft + 1
    assert policy.plan(2, draft_len=15, limit=3)[0] == 3  # nor than the tokens left
    for _ in range(8):  # one-token matches: always wrong
        round_of(1, lambda w: 0)
    assert policy.plan(1, draft_len=15, limit=16)[0] == 1
    assert policy.plan(2, draft_len=15, limit=16)[0] == 16  # tracked apart per match length
    shrinking = [round_of(2, lambda w: 0) for _ in range(10)]  # the text stops copying
    assert shrinking == sorted(shrinking, reverse=True) and shrinking[-1] < 8
    written_off = [round_of(1) for _ in range(60)]  # written off for a while, then tried again
    assert max(written_off) > 1


def test_a_text_that_copies_nothing_stops_lookup_rounds_at_every_match_length():
    # chat: one-token and two-token matches fail again and again; a three-token match then gets
    # no round of its own either, where alone its prior (0.8) would have bought one
    fresh, policy = LookupPolicy(COSTS, max_ngram=3), LookupPolicy(COSTS, max_ngram=3)
    plain_speed = 1.0 / COSTS.at(1)
    assert fresh.plan(3, draft_len=15, limit=16)[1] > plain_speed  # a lookup round would be taken
    for ngram in (1, 2) * 12:  # as many failing copies as a chat reply of 128 tokens meets
        policy.next_round()
        policy.observe(ngram, 2, 0)
    assert policy.prior_scale() < 0.2
    assert policy.plan(3, draft_len=15, limit=16)[0] == 1  # width 1: no lookup round
    for _ in range(3):  # a text that starts copying gives every length its prior back
        policy.next_round()
        policy.observe(2, 16, 15)
    assert policy.prior_scale() == 1.0
    assert policy.plan(3, draft_len=15, limit=16) == fresh.plan(3, draft_len=15, limit=16)


def lookup_run(engine, monkeypatch, prompt_ids, reference, **params):
    use_policy(monkeypatch, lambda width, whole: BlockPolicy(
        COSTS, [0.5] * 15, max_width=width, whole_block_drafts=whole))
    real = type(engine).make_drafter.__get__(engine)
    # every draft of the drafter is wrong: the block policy falls back, any gain is lookup's
    monkeypatch.setattr(engine, "make_drafter", lambda window=None: ReferenceDrafter(
        real(window), len(prompt_ids), reference, right=lambda index, offset: False))
    return collect(engine.stream(prompt_ids, GenerationParams(
        max_tokens=len(reference), block_size=parse_block_size("auto"), stop_token_ids=(-1,), **params)))


def repeating_prompt(engine) -> list[int]:
    """A prompt whose text repeats: the plain continuation of a tiny random model copies it
    often enough for lookup rounds to win (checked by the assertions, not assumed)."""
    return [1] + [40, 71, 88, 101, 33, 72, 99, 12] * 6


def check(engine, monkeypatch):
    prompt_ids = repeating_prompt(engine)
    reference, _ = collect(engine.stream(prompt_ids, GenerationParams(
        max_tokens=60, speculative=False, stop_token_ids=(-1,))))
    tokens, events = lookup_run(engine, monkeypatch, prompt_ids, reference)
    assert tokens == reference  # token for token
    lookups = [e for e in events[1:] if e.mode == LOOKUP]
    assert lookups and sum(e.accepted for e in lookups) > 0
    assert all(e.drafted == e.width - 1 for e in lookups)
    # a lookup round's accepted drafts are all copies: the chat app colours them as such
    assert all(e.lookup_accepted == e.accepted and e.lookup_accepted_chars == e.accepted_chars for e in lookups)
    assert any(e.lookup_accepted_chars > 0 for e in lookups)

    without, events_off = lookup_run(engine, monkeypatch, prompt_ids, reference, prompt_lookup=False)
    assert without == reference and LOOKUP not in {e.mode for e in events_off}
    assert len(events) < len(events_off)  # fewer rounds for the same tokens


def test_lookup_rounds_are_lossless_and_save_rounds_torch(tmp_path_factory, monkeypatch):
    check(tiny_engine(tiny_pair(tmp_path_factory, "llama")), monkeypatch)


def test_lookup_rounds_are_lossless_and_save_rounds_mlx(tmp_path, monkeypatch):
    pytest.importorskip("mlx.core")
    from mlx_tiny import write_target
    from tiny_models import make_drafter

    from dflash_local.engines.mlx_engine import MLXEngine

    target_dir = write_target(tmp_path / "target", "qwen3", seed=3)
    raw = json.loads((target_dir / "config.json").read_text())
    drafter_dir = make_drafter(tmp_path / "drafter", target_dir, layers=2, taps=[1, 3, 4])
    assert raw["model_type"] == "qwen3"
    check(MLXEngine(target_dir, drafter_dir), monkeypatch)


def test_fixed_block_sizes_stay_pure_dflash(tmp_path_factory):
    engine = tiny_engine(tiny_pair(tmp_path_factory, "llama"))
    prompt_ids = repeating_prompt(engine)
    _, events = collect(engine.stream(prompt_ids, GenerationParams(max_tokens=30, block_size=parse_block_size(4))))
    assert LOOKUP not in {e.mode for e in events}


def _one_period_propose(index: NgramIndex, max_tokens: int):
    """NgramIndex.propose without the overlapping copy: at most what the text holds."""
    draft = _OVERLAPPING_PROPOSE(index, max_tokens)
    if draft is None:
        return None
    start = index._next[tuple(index.tokens[len(index.tokens) - draft.ngram :])]
    return replace(draft, token_ids=draft.token_ids[: len(index.tokens) - start])


_OVERLAPPING_PROPOSE = NgramIndex.propose


def test_lookup_drafts_ride_along_in_drafter_trees_and_stay_lossless(tmp_path_factory, monkeypatch):
    """Under auto with trees, a drafter round verifies the lookup draft too, grafted onto its
    tree (draft_tree.DraftTree.graft): the drafter here is right on one draft a round at most,
    so a drafter round that keeps more kept the copy."""
    from fixtures_tiny import ScriptedTreeDrafter, follow

    from dflash_local.drafter.model_torch import DraftSession
    from dflash_local.method.planning.modes import SPECULATIVE

    engine = tiny_engine(tiny_pair(tmp_path_factory, "qwen3"))
    # this tiny target's plain continuation goes round in short loops: a copy is often right
    prompt_ids = engine.encode_chat([{"role": "user", "content": "Once upon a time, in a"}])
    reference, _ = collect(engine.stream(prompt_ids, GenerationParams(
        max_tokens=60, speculative=False, stop_token_ids=(-1,))))
    # a drafter pass costs 5% of a plain step, a row 2%: drafter rounds are cheap to take
    verify = tuple(1.0 + 0.02 * w for w in range(16))
    costs = RoundCosts((1.0, *(v + 0.05 for v in verify[1:])), verify)
    policies = []

    def make_policy(width, whole):
        policies.append(BlockPolicy(costs, [0.9] * 15, max_width=width, whole_block_drafts=whole))
        return policies[-1]

    use_policy(monkeypatch, make_policy)
    # copies cut at the end of the text (one period of this loop): a copy then rides along more
    # often than it goes alone, so rounds where the drafter and a copy both kept tokens occur
    monkeypatch.setattr(NgramIndex, "propose", _one_period_propose)
    monkeypatch.setattr(engine, "make_drafter", lambda window=None: ScriptedTreeDrafter(
        prompt_ids, follow(reference, len(prompt_ids), right=1), chain=4,
        inner=DraftSession(engine.drafter, window=window)))

    def run(**params):
        tokens, events = collect(engine.stream(prompt_ids, GenerationParams(
            max_tokens=len(reference), block_size=parse_block_size("auto"), stop_token_ids=(-1,), **params)))
        assert tokens == reference  # token for token
        return [e for e in events[1:] if e.mode == SPECULATIVE]

    with_lookup = run()
    assert with_lookup and max(e.accepted for e in with_lookup) >= 2
    # what the drafter got right is told apart from what a grafted copy brought after it
    assert all(e.accepted - e.lookup_accepted <= 1 for e in with_lookup)
    assert all(e.lookup_accepted >= 1 for e in with_lookup if e.accepted >= 2)
    assert any(e.lookup_accepted >= 1 and e.accepted - e.lookup_accepted == 1 for e in with_lookup)  # both kept
    for e in with_lookup:  # and the text says which characters each made
        copied_text = engine.decode(e.token_ids[e.accepted - e.lookup_accepted : e.accepted])
        if "\ufffd" not in engine.decode(e.token_ids):
            assert e.text[e.accepted_chars - e.lookup_accepted_chars : e.accepted_chars] == copied_text
    assert any(e.lookup_accepted_chars > 0 for e in with_lookup)
    # the drafter is judged on its own drafts: never right past the first, so its estimate never
    # saw a round reach the third position, whatever copies grafted on kept
    assert policies[-1].estimate.seen[2] == 0 and policies[-1].rates()[1] < 0.5
    alone = run(prompt_lookup=False)
    assert max(e.accepted for e in alone) <= 1 and not any(e.lookup_accepted for e in alone)  # the control
    # sampling walks grafted trees too (acceptance.sampled_walk): it runs to max_tokens
    sampled = collect(engine.stream(prompt_ids, GenerationParams(
        max_tokens=len(reference), block_size=parse_block_size("auto"), temperature=0.7, seed=1, stop_token_ids=(-1,))))[1]
    assert len(sampled) > 1 and sum(len(e.token_ids) for e in sampled) == len(reference)
