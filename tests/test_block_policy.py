"""The auto block size: the policy's choice on synthetic acceptance/cost data, its fallback to
plain decoding and its way back, the calibration cache, and losslessness with "auto" on tiny
pairs (Transformers and MLX) with a scripted drafter that is right, then useless, then right."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from fixtures_tiny import ReferenceDrafter, collect, tiny_engine, tiny_pair, use_policy

from dflash_local.errors import InvalidRequestError
from dflash_local.events import AUTO, GenerationParams, parse_block_size
from dflash_local.method import calibration
from dflash_local.method.draft_tree import DraftTree
from dflash_local.method.planning.auto import AutoPlanner
from dflash_local.method.planning.costs import RoundCosts, expected_committed
from dflash_local.method.planning.lookups import LookupPolicy
from dflash_local.method.planning.modes import FALLBACK, LOOKUP, PROBE, SPECULATIVE
from dflash_local.method.planning.planner import timed_rounds
from dflash_local.method.planning.trees import TreeSizer
from dflash_local.method.planning.widths import BlockPolicy
from dflash_local.method.proposers import Draft, DrafterChain, DrafterTree

# a drafter pass that costs half a plain step: speculation must earn it back (MLX-like)
COSTS = RoundCosts(tuple([1.0] + [1.5 + 0.05 * (w - 1) for w in range(2, 17)]))


def brute_force_best(costs: RoundCosts, rates, limit: int) -> int:
    speeds = []
    for width in range(1, limit + 1):
        committed = 1.0 + sum(np.prod(rates[:k]) for k in range(1, width))
        speeds.append(committed / costs.at(width))
    return 1 + int(np.argmax(speeds))


def test_expected_committed_counts_the_bonus_token():
    assert expected_committed([1.0, 1.0, 1.0], 4) == 4.0
    assert expected_committed([0.5, 0.5], 3) == pytest.approx(1.75)
    assert expected_committed([0.9] * 15, 1) == 1.0


def test_policy_picks_the_argmax_of_expected_tokens_per_second():
    rng = np.random.default_rng(0)
    for _ in range(200):
        width = int(rng.integers(2, 17))
        costs = RoundCosts(tuple(np.cumsum(rng.uniform(0.01, 0.5, width)) + 1.0))
        rates = rng.uniform(0.0, 1.0, width - 1)
        policy = BlockPolicy(costs, rates)
        expected = brute_force_best(costs, policy.rates(), width)
        assert policy.best_width() == expected
        limit = int(rng.integers(1, width + 1))
        assert policy.best_width(limit) == brute_force_best(costs, policy.rates(), limit)


def test_cheap_wide_verify_and_good_drafter_mean_wide_blocks():
    flat = RoundCosts((1.0,) + (1.05,) * 15)
    assert BlockPolicy(flat, [0.95] * 15).best_width() == 16
    steep = RoundCosts(tuple(1.0 + 0.5 * (w - 1) for w in range(1, 17)))
    assert BlockPolicy(steep, [0.95] * 15).best_width() < 10
    assert BlockPolicy(COSTS, [0.0] * 15).best_width() == 1


def test_whole_block_drafts_pay_the_widest_drafter_pass_at_every_width():
    # verify 1.0 + 0.02 per row; the drafter pass 0.05 per drafted position
    verify = tuple(1.0 + 0.02 * (w - 1) for w in range(1, 17))
    costs = RoundCosts(tuple(v + 0.05 * (w - 1) for w, v in enumerate(verify, 1)), verify)
    policy = BlockPolicy(costs, [0.3] + [0.0] * 14)
    assert policy.best_width() == 2  # 1.3 tokens for 1.07 s beats 1 token for 1 s...
    assert policy.round_seconds(16) == costs.seconds
    policy.whole_block_drafts = True  # ...but not for 1.77 s: every round drafts 16 wide
    assert policy.round_seconds(16)[1] == pytest.approx(1.02 + 0.75)
    assert policy.best_width() == 1 and policy.choose(remaining=1000).mode == FALLBACK
    assert policy.round_seconds(4)[1] == pytest.approx(1.02 + 0.15)  # near the end: 4 wide
    assert policy.best_tokens_per_s(16) == pytest.approx(1.0)


def drive(policy: BlockPolicy, right_for, rounds: int, start: int = 0):
    """Run the policy against a drafter whose first right_for(round) drafts are right."""
    choices = []
    for index in range(start, start + rounds):
        choice = policy.choose(remaining=1000)
        policy.observe(choice.width, min(right_for(index), choice.width - 1))
        choices.append(choice)
    return choices


def test_falls_back_to_plain_when_acceptance_is_zero_and_probes_rarely():
    policy = BlockPolicy(COSTS, [0.8] * 15, probe_budget=1.0)  # the doubling alone
    choices = drive(policy, lambda _: 0, 400)
    assert choices[0].mode == SPECULATIVE and choices[0].width > 1
    first_fallback = next(i for i, c in enumerate(choices) if c.mode == FALLBACK)
    assert first_fallback < 10
    after = choices[first_fallback:]
    assert all(c.width == 1 for c in after if c.mode == FALLBACK)
    probes = [i for i, c in enumerate(after) if c.mode == PROBE]
    assert probes and all(after[i].width > 1 for i in probes)
    gaps = np.diff(probes)
    assert list(gaps) == sorted(gaps) and gaps[-1] <= policy.max_probe_every + 1  # backing off
    assert len(probes) / len(after) < 0.05


def test_comes_back_when_acceptance_recovers():
    policy = BlockPolicy(COSTS, [0.8] * 15, probe_budget=1.0)
    drive(policy, lambda _: 15, 30)
    assert policy.mode == SPECULATIVE
    drive(policy, lambda _: 0, 300)
    assert policy.mode == FALLBACK
    recovered = drive(policy, lambda _: 15, 200)
    back = next(i for i, c in enumerate(recovered) if c.mode == SPECULATIVE)
    assert back <= policy.max_probe_every + 1
    assert all(c.mode == SPECULATIVE for c in recovered[back:])
    assert recovered[-1].width == 16


def test_probes_of_a_dear_width_stay_within_the_budget():
    policy = BlockPolicy(COSTS, [0.8] * 15, probe_budget=0.01)
    choices = drive(policy, lambda _: 0, 2000)[50:]
    extra = sum(COSTS.at(c.width) - COSTS.at(1) for c in choices if c.mode == PROBE)
    assert 0 < extra <= 0.012 * len(choices)  # probes of width >= 2 cost 1.5x a plain step here


def test_a_probe_under_tree_rounds_is_a_short_chain_priced_as_one():
    """Auto's tree rounds draft a whole block and a sizer picks the rows after drafting; a probe
    must cost what its budget priced: the drafter's chain of the probe's width (the cheapest
    drafter pass), which the tree sizer does not learn from."""
    verify = tuple(1.0 + 0.05 * (w - 1) for w in range(1, 17))
    draft = [0.0] + [0.1 + 0.02 * w for w in range(2, 17)]  # a wider drafter pass costs more
    costs = RoundCosts(tuple(v + d for v, d in zip(verify, draft)), verify)
    planner = AutoPlanner(costs, [0.05] * 15, widest=16, trees=True)
    probes = []
    for _ in range(400):
        proposer = planner.plan(100, 1000)
        width = getattr(proposer, "width", 1)
        assert not isinstance(proposer, DrafterTree), "a probe drafted a whole tree"
        if isinstance(proposer, DrafterChain):
            assert proposer.mode == PROBE
            probes.append(width)
        tree = DraftTree.chain([5] * (width - 1))
        planner.observe(Draft(tree, proposer.mode, drafter_nodes=width - 1), [], [1])
    assert probes and set(probes) == {planner.policy._probe(16)[0]}
    assert 2 <= probes[0] < 16 and planner.sizer.predicted == planner.sizer.kept == 0
    extra = sum(costs.at(w) - costs.at(1) for w in probes)  # within the 1% budget, as a chain
    assert extra <= 0.012 * 400


def test_partial_acceptance_settles_on_the_width_it_earns():
    policy = BlockPolicy(RoundCosts(tuple(1.0 + 0.05 * (w - 1) for w in range(1, 17))), [0.5] * 15)
    widths = [choice.width for choice in drive(policy, lambda _: 3, 60)]
    assert widths[-30:].count(4) >= 25  # 3 drafts always right, the 4th always wrong
    assert min(policy.rates()[:3]) > 0.95 and policy.rates()[3] < 0.5  # 5 now and then: explore


def test_never_wider_than_the_tokens_left():
    policy = BlockPolicy(RoundCosts.uncalibrated(16), [1.0] * 15)
    assert policy.choose(remaining=3).width == 3
    assert policy.choose(remaining=1).width == 1


def test_params_accept_auto_and_nothing_else():
    assert GenerationParams(block_size=parse_block_size("auto")).block_size == AUTO
    with pytest.raises(InvalidRequestError, match="integer or 'auto'"):
        GenerationParams(block_size=parse_block_size("wide"))
    with pytest.raises(InvalidRequestError, match=r"Fixed\(n\) or Auto\(\)"):
        GenerationParams(block_size="auto")


# --- the real loop: lossless with "auto", through fallback, probes and recovery ---

MAX_TOKENS = 90
RIGHT_PREFIX = 3  # in the good phases the first 3 drafts of a block are right


def is_good(index: int) -> bool:
    return index < 14 or index >= 50


def auto_run(engine, monkeypatch, prompt_ids, reference):
    use_policy(monkeypatch, lambda width, whole: BlockPolicy(
        COSTS, [0.8] * 15, max_width=width, probe_every=3, max_probe_every=6,
        probe_budget=1.0, whole_block_drafts=whole))
    real = type(engine).make_drafter.__get__(engine)
    def right(index: int, offset: int) -> bool:  # good phases: the first drafts of a block
        return is_good(index) and offset < RIGHT_PREFIX

    monkeypatch.setattr(engine, "make_drafter",
                        lambda window=None: ReferenceDrafter(real(window), len(prompt_ids),
                                                             reference, right))
    # lookup rounds off: this checks the block policy alone (test_lookup.py checks them)
    params = GenerationParams(max_tokens=MAX_TOKENS, block_size=parse_block_size("auto"), stop_token_ids=(-1,),
                              prompt_lookup=False)
    return collect(engine.stream(prompt_ids, params))


def check_phases(tokens, events, reference):
    assert tokens == reference
    modes = [event.mode for event in events[1:]]
    assert FALLBACK in modes and PROBE in modes
    first_fallback = modes.index(FALLBACK)
    assert SPECULATIVE in modes[first_fallback:], "never came back after the drafter recovered"
    assert all(e.width == 1 for e in events[1:] if e.mode == FALLBACK)
    assert any(e.accepted == RIGHT_PREFIX for e in events[1:] if e.mode == SPECULATIVE)


def test_auto_is_lossless_through_fallback_and_recovery_torch(tmp_path_factory, monkeypatch):
    engine = tiny_engine(tiny_pair(tmp_path_factory, "qwen3"))
    prompt_ids = engine.encode_chat([{"role": "user", "content": "hello world"}])
    reference, _ = collect(engine.stream(prompt_ids, GenerationParams(
        max_tokens=MAX_TOKENS, speculative=False, stop_token_ids=(-1,))))
    tokens, events = auto_run(engine, monkeypatch, prompt_ids, reference)
    check_phases(tokens, events, reference)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_auto_is_lossless_through_fallback_and_recovery_mlx(tmp_path, monkeypatch, family):
    pytest.importorskip("mlx.core")
    from mlx_tiny import write_target
    from tiny_models import make_drafter

    from dflash_local.engines.mlx_engine import MLXEngine

    target_dir = write_target(tmp_path / "target", family, seed=3)
    raw = json.loads((target_dir / "config.json").read_text())
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "config.json").write_text(json.dumps(raw.get("text_config") or raw))
    drafter_dir = make_drafter(tmp_path / "drafter", flat, layers=2, taps=[1, 3, 4])
    engine = MLXEngine(target_dir, drafter_dir)
    prompt_ids = [1, 40, 71, 88, 101, 33, 72, 99, 12, 250, 5, 64]
    reference, _ = collect(engine.stream(prompt_ids, GenerationParams(
        max_tokens=MAX_TOKENS, speculative=False, stop_token_ids=(-1,))))
    tokens, events = auto_run(engine, monkeypatch, prompt_ids, reference)
    check_phases(tokens, events, reference)


def test_auto_with_the_real_calibration_is_lossless_and_cached(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("DFLASH_LOCAL_HOME", str(tmp_path_factory.mktemp("calibration_home")))
    engine = tiny_engine(tiny_pair(tmp_path_factory, "llama"))
    engine.calibration = None
    measured = engine.calibrate()
    block = engine.pair.drafter_block
    seconds = measured.costs.seconds
    assert len(seconds) == block and len(measured.prior) == block - 1
    assert all(b >= a for a, b in itertools.pairwise(seconds)) and seconds[1] > seconds[0]
    assert all(0.0 <= rate <= 1.0 for rate in measured.prior)
    slopes = measured.costs.context_slopes  # timed on a long context: >= 0, wider never flatter
    assert len(slopes) == block and all(b >= a >= 0 for a, b in itertools.pairwise(slopes))
    assert 0 < measured.costs.base_context < calibration.LONG_CONTEXT
    cached = calibration.cache_path(calibration.calibration_key(engine.pair, engine.compute_threads()))
    assert json.loads(cached.read_text())["round_seconds"] == list(seconds)
    engine.calibration = None
    assert engine.calibrate().costs == measured.costs  # read back, not re-measured
    assert engine.calibration.costs == measured.costs  # the engine holds it for its generations

    prompt_ids = engine.encode_chat([{"role": "user", "content": "Once upon a time"}])
    plain, _ = collect(engine.stream(prompt_ids, GenerationParams(max_tokens=30, speculative=False)))
    tokens, events = collect(engine.stream(prompt_ids, GenerationParams(max_tokens=30,
                                                                        block_size=parse_block_size("auto"))))
    assert tokens == plain
    assert {event.mode for event in events} <= {SPECULATIVE, FALLBACK, PROBE, LOOKUP}
    times = engine.round_times  # the rounds it timed, kept for the engine's next generations
    assert 0 < len(times.plain) + len(times.wider) <= len(events) - 1
    engine.calibrate()  # read back from its cache: timed afresh from now on
    assert engine.round_times is not times and not engine.round_times.wider


@pytest.mark.parametrize("tree", [True, False])
def test_auto_prices_its_tree_rounds_as_whole_block_drafts(tmp_path_factory, monkeypatch, tree):
    """Under auto with trees every drafter round drafts all it may and verifies a prefix: the
    policy must price that drafter pass (measured per drafted width) at every verified width."""
    engine = tiny_engine(tiny_pair(tmp_path_factory, "llama"))
    policies, nodes = [], []
    use_policy(monkeypatch, lambda width, whole: policies.append(
        BlockPolicy(COSTS, [0.8] * 15, max_width=width, whole_block_drafts=whole)) or policies[-1])
    make_drafter = engine.make_drafter

    def recording_drafter(window=None):
        session = make_drafter(window)
        propose_tree = session.propose_tree
        session.propose_tree = lambda anchor, taps, count: nodes.append(count) or propose_tree(
            anchor, taps, count)
        return session

    monkeypatch.setattr(engine, "make_drafter", recording_drafter)
    prompt_ids = engine.encode_chat([{"role": "user", "content": "Once upon a time"}])
    max_tokens = 3 * engine.pair.drafter_block
    _, events = collect(engine.stream(prompt_ids, GenerationParams(
        max_tokens=max_tokens, block_size=parse_block_size("auto"), stop_token_ids=(-1,), prompt_lookup=False,
        tree=tree)))
    assert policies[0].whole_block_drafts is tree
    left, allowed = max_tokens, []  # the tokens left before each drafter round
    for event in events:
        if event.drafted:
            allowed.append(min(engine.pair.drafter_block, left) - 1)
        left -= len(event.token_ids)
    # each tree drafted as wide as the block, or as the tokens left, allow; no trees without
    assert nodes == (allowed if tree else []) and (nodes or not tree)


def test_rounds_are_priced_at_the_context_they_run_on():
    """A wide verify that grows dearer with the context than a 1-row step (MLX on a CPU) makes
    the policy narrower on a long context; costs never drop below the timed ones."""
    seconds = tuple(1.0 + 0.05 * (w - 1) for w in range(1, 17))
    verify = (1.0, *(s - 0.01 for s in seconds[1:]))  # a drafter pass of 0.01
    slopes = tuple(0.0002 * (w - 1) for w in range(1, 17))  # 16 rows: +0.3 steps per 100 tokens
    costs = RoundCosts(seconds, verify, base_context=100, context_slopes=slopes)
    assert costs.at_context(50) is costs and costs.at_context(100) is costs
    long = costs.at_context(2100)
    assert long.at(1) == pytest.approx(1.0) and long.at(16) == pytest.approx(1.75 + 0.003 * 2000)
    assert long.verify_only[15] == pytest.approx(1.74 + 0.003 * 2000)
    assert long.draft_seconds(16) == pytest.approx(0.01)  # the drafter pass is not repriced
    assert long.context_slopes is None and long.at_context(4100) is long  # priced once
    policy = BlockPolicy(costs, [0.7] * 15)
    short_width = policy.best_width()
    assert policy.price_context(2100) == long and policy.costs == long
    assert 1 < policy.best_width() < short_width
    assert policy.price_context(100) is costs and policy.best_width() == short_width
    with pytest.raises(ValueError):
        RoundCosts(seconds, seconds, 100, slopes[:4])


def test_the_loop_prices_each_round_at_its_context(tmp_path_factory, monkeypatch):
    engine = tiny_engine(tiny_pair(tmp_path_factory, "llama"))
    seconds = tuple(1.0 + 0.05 * (w - 1) for w in range(1, 17))
    costs = RoundCosts(seconds, seconds, base_context=1, context_slopes=tuple([0.001] * 16))
    priced = []
    policy = BlockPolicy(costs, [0.8] * 15, max_width=engine.pair.drafter_block, whole_block_drafts=True)
    price_context = policy.price_context
    policy.price_context = lambda tokens, lanes=1: priced.append(tokens) or price_context(tokens, lanes)
    use_policy(monkeypatch, lambda width, whole: policy)
    current = {TreeSizer: [], LookupPolicy: []}  # each pricing part: priced as the policy is?
    for part, method in ((TreeSizer, "size"), (LookupPolicy, "plan")):
        original = getattr(part, method)
        monkeypatch.setattr(part, method, lambda self, *args, _part=part, _original=original: (
            current[_part].append(self.costs is policy.costs) or _original(self, *args)))
    prompt_ids = engine.encode_chat([{"role": "user", "content": "the cat and the cat and the"}])
    _, events = collect(engine.stream(prompt_ids, GenerationParams(
        max_tokens=40, block_size=parse_block_size("auto"), stop_token_ids=(-1,))))
    produced = list(itertools.accumulate(len(event.token_ids) for event in events))
    assert priced == [len(prompt_ids) + count for count in produced[:-1]]  # before every round
    assert policy.costs.at(1) == pytest.approx(1.0 + 0.001 * (priced[-1] - 1))
    assert current[TreeSizer] and all(current[TreeSizer])
    assert current[LookupPolicy] and all(current[LookupPolicy])


class _Clock:
    now = 0.0


class _ClockedRunner:
    """Verifying w rows on c tokens of context takes 0.01 + 1e-5 * w * c seconds of `clock`."""

    def __init__(self, clock: _Clock, max_context: int):
        self.clock, self.max_context, self.length = clock, max_context, 0

    def prefill(self, ids):
        self.length = len(ids)
        return None, None

    def verify(self, anchor_id, tree):
        self.clock.now += 0.01 + 1e-5 * (len(tree.token_ids) + 1) * self.length

    def commit(self, rows):
        self.length += len(rows)


class _ClockedEngine:
    def __init__(self, clock: _Clock, max_context: int):
        self.clock, self.max_context = clock, max_context

    def make_runner(self, collect_taps: bool):
        return _ClockedRunner(self.clock, self.max_context)


def test_context_slopes_recover_how_a_verify_grows_with_the_context(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(calibration.time, "perf_counter", lambda: clock.now)
    timer = calibration.LongContextTimer.open(_ClockedEngine(clock, 8192), list(range(40)),
                                              timed_rounds(16, True), short_context=100, repetitions=4)
    assert timer.widths == [1, 2, 3, 8, 16]
    for repetition in range(5):
        for shape in timed_rounds(16, True):
            timer.time(shape, keep=repetition > 0)
    assert timer.runner.length == timer.tokens + 5 * 5  # only the timed widths ran, one row kept each
    short = [0.01 + 1e-5 * w * 100 for w in range(1, 17)]  # as if timed on 100 tokens
    assert timer.slopes(short, 100) == pytest.approx([1e-5 * w for w in range(1, 17)], rel=0.05)
    # a context window too short to time a long context: no slopes, not made-up ones
    assert calibration.LongContextTimer.open(_ClockedEngine(clock, 250), list(range(40)),
                                             timed_rounds(16, True), short_context=120,
                                             repetitions=4) is None


def test_calibration_costs_ignore_rounds_that_other_work_slowed_down():
    # 8 repetitions, 3 of them slowed by a busy CPU: the cost stays the quiet one (a median
    # would not: 4 slow of 8 moves it halfway)
    assert calibration.lower_quartile([0.1, 0.1, 0.1, 0.1, 0.1, 0.3, 0.3, 0.3]) == pytest.approx(0.1)
    assert calibration.lower_quartile([0.1, 0.1, 0.1, 0.1, 0.3, 0.3, 0.3, 0.3]) == pytest.approx(0.1)
    assert calibration.lower_quartile([0.1, 0.2, 0.3, 0.4, 0.5]) == pytest.approx(0.2)
    assert calibration.lower_quartile([0.7]) == 0.7
