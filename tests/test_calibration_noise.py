"""A calibration a busy moment cannot poison: one measured beside busy processes is measured
again and kept marked unreliable (its cache file, the engine's status, the CLI's line), and the
auto planner re-prices rounds whose timed cost contradicts the calibration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
from fixtures_tiny import collect, tiny_engine, tiny_pair

from dflash_local import machine_load
from dflash_local.events import GenerationParams, parse_block_size
from dflash_local.method import calibration, speculative
from dflash_local.method.calibration_noise import (
    BUSY_SHARE,
    SPREAD_LIMIT,
    Noise,
    spread,
    warning_line,
)
from dflash_local.method.draft_tree import DraftTree
from dflash_local.method.planning.auto import UNCHECKED_PROBE_EVERY
from dflash_local.method.planning.costs import RoundCosts
from dflash_local.method.planning.modes import FALLBACK, PROBE, SPECULATIVE
from dflash_local.method.planning.observed import MIN_ROUNDS, ObservedCosts, RoundTimes
from dflash_local.method.planning.planner import make_planner


def test_noise_names_each_sign_and_a_quiet_measurement_has_none():
    quiet = Noise(spread=0.05, others_cores=0.1, load_average=0.3, cores=4)
    assert quiet.reliable and quiet.reasons == []
    noisy = Noise(spread=SPREAD_LIMIT + 0.1, others_cores=BUSY_SHARE * 4 + 0.5, load_average=5.0, cores=4)
    assert not noisy.reliable and len(noisy.reasons) == 2
    assert "differ by 40%" in noisy.reasons[0] and "1.5 of 4 cores" in noisy.reasons[1]
    assert Noise.from_json(noisy.to_json()) == noisy
    assert spread({1: [1.0, 1.0, 1.0, 1.0], 2: [1.0, 1.0, 2.0, 2.0], 3: [1.0, 1.0, 1.0, 3.0]}) == \
        pytest.approx(0.5)  # widths: 0, 1.0, 0.5 -> the median


def test_others_cores_leaves_this_processes_own_time_out():
    start = machine_load.LoadSample(wall_s=10.0, own_cpu_s=1.0, busy_s=100.0)
    end = machine_load.LoadSample(wall_s=12.0, own_cpu_s=3.0, busy_s=105.0)
    assert machine_load.others_cores(start, end) == pytest.approx(1.5)  # (5 - 2) / 2 s
    assert machine_load.others_cores(start, machine_load.LoadSample(12.0, 3.0, None)) is None


@pytest.fixture
def busy_processes():
    """A busy loop per core beside the test, as a background build runs: at the lowest priority,
    so that it takes the CPU the calibration leaves and the test stays short."""
    spin = "import os\nos.nice(19)\nwhile True: pass"
    spinners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(os.cpu_count() or 1)]
    try:
        yield spinners
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def test_a_calibration_beside_busy_processes_is_measured_again_and_kept_marked(
        tmp_path_factory, monkeypatch, busy_processes):
    monkeypatch.setenv("DFLASH_LOCAL_HOME", str(tmp_path_factory.mktemp("busy_calibration")))
    engine = tiny_engine(tiny_pair(tmp_path_factory, "llama", block_size=4))  # 4 widths: quick
    tries = []
    measure_costs = calibration.measure_costs
    monkeypatch.setattr(calibration, "measure_costs",
                        lambda *args: tries.append(1) or measure_costs(*args))
    previous = engine.calibration
    try:
        measured = engine.calibrate(force=True)
        status = engine.calibration_status()
    finally:
        engine.calibration = previous
    assert not measured.reliable and measured.noise.reasons
    assert len(tries) == 1 + calibration.NOISY_RETRIES  # noisy: measured once more
    if machine_load.sample().busy_s is not None:  # Linux: the busy loops' CPU time is seen
        assert measured.noise.others_cores > BUSY_SHARE * measured.noise.cores
    cached = json.loads(calibration.cache_path(measured.key).read_text())
    assert cached["reliable"] is False and cached["noise"]["reasons"] == measured.noise.reasons
    read_back = calibration.Calibration.from_json(cached)
    assert not read_back.reliable and read_back.noise.reasons == measured.noise.reasons
    assert not measured.costs.reliable and not read_back.costs.reliable  # what the planner sees
    auto = make_planner(GenerationParams(block_size=parse_block_size("auto")), 4, False, [1, 2],
                        read_back.costs, read_back.prior)
    assert auto.policy.sooner_probe_every == UNCHECKED_PROBE_EVERY
    assert status["reliable"] is False and status["noise"]["reasons"] == measured.noise.reasons
    line = warning_line(status)
    assert "busy" in line and measured.noise.reasons[0] in line and "--recalibrate" in line


# a toy target: the token after t is always (3t + 1) mod VOCAB, whatever came before
VOCAB = 97


def next_token(token: int) -> int:
    return (3 * token + 1) % VOCAB


class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class _ClockedRunner:
    """The toy target; verifying r rows advances `clock` by plain_s + row_s * (r - 1)."""

    max_context, supports_tree = 4096, False

    def __init__(self, clock: _Clock, plain_s: float, row_s: float):
        self.clock, self.plain_s, self.row_s = clock, plain_s, row_s

    def prefill(self, prompt_ids, start=0):
        return self._logits([prompt_ids[-1]])[0], np.zeros(len(prompt_ids))

    def verify(self, anchor_id, tree: DraftTree):
        self.clock.now += self.plain_s + self.row_s * len(tree.token_ids)
        return self._logits([anchor_id, *tree.token_ids])

    def commit(self, rows):
        return np.zeros(len(rows))

    def join_taps(self, chunks):
        return np.concatenate(chunks)

    @staticmethod
    def _logits(tokens):
        logits = np.zeros((len(tokens), VOCAB), dtype=np.float32)
        logits[np.arange(len(tokens)), [next_token(t) for t in tokens]] = 1.0
        return logits


class _RightDrafter:
    drafter_block, tree_drafts = 16, False

    def propose(self, anchor_id, new_taps, width):
        drafts = [next_token(anchor_id)]
        while len(drafts) < width - 1:
            drafts.append(next_token(drafts[-1]))
        return drafts[: width - 1]


# calibrated: any width costs about a plain step, so auto drafts the whole block
CHEAP_WIDE = RoundCosts(tuple(1.0 + 0.01 * (w - 1) for w in range(1, 17)), timed=True)


def auto_rounds(monkeypatch, row_s: float, costs: RoundCosts = CHEAP_WIDE, plain_s: float = 1.0,
                times: RoundTimes | None = None):
    """The events of an auto generation over the clocked toy pair: the planner's calibration
    `costs`, a plain step really taking `plain_s` and each verified row past the anchor `row_s`;
    `times`: rounds earlier generations timed (an engine's)."""
    clock = _Clock()
    monkeypatch.setattr(speculative.time, "perf_counter", clock)
    runner, drafter = _ClockedRunner(clock, plain_s, row_s), _RightDrafter()
    params = GenerationParams(max_tokens=120, block_size=parse_block_size("auto"),
                              stop_token_ids=(-1,), prompt_lookup=False)
    planner = speculative.default_planner(runner, drafter, [5, 6, 7], params, costs, [0.9] * 15,
                                          times)
    _, events = collect(speculative.generate(runner, drafter, [5, 6, 7], params, planner))
    return events[1:], planner


def test_rounds_that_contradict_the_calibration_re_price_the_rest(monkeypatch):
    """Verified rows really cost 3 plain steps each: a drafter round of any width commits fewer
    tokens than the plain steps it costs, whatever the calibration said."""
    rounds, planner = auto_rounds(monkeypatch, row_s=3.0)
    modes = [event.mode for event in rounds]
    assert modes[0] == SPECULATIVE and rounds[0].width == 16  # the calibration, believed at first
    reference = modes.index(FALLBACK)  # then plain steps timed to compare the rounds with
    assert SPECULATIVE not in modes[reference:], modes  # re-priced: speculation loses
    assert set(modes[reference:]) <= {FALLBACK, PROBE} and modes[-20:].count(FALLBACK) >= 19
    plain_scale, wider_scale = planner.observed.scales()
    assert plain_scale == pytest.approx(1.0) and wider_scale > 10  # what the rounds took
    assert planner.policy.costs.at(2) == pytest.approx(CHEAP_WIDE.at(2) * wider_scale)


def test_rounds_that_agree_with_the_calibration_keep_it(monkeypatch):
    rounds, planner = auto_rounds(monkeypatch, row_s=0.01)
    assert {event.mode for event in rounds} == {SPECULATIVE}
    assert all(event.width == 16 for event in rounds[:-1])
    assert planner.observed.scales() == (1.0, 1.0)


def test_a_slower_machine_is_checked_with_plain_steps_once_not_in_every_generation(monkeypatch):
    """Every round twice its calibrated price (a busy machine): the first generation times plain
    steps to tell that from a dear verify, then speculates again; the next generations of the
    same engine (its RoundTimes) know already and never leave the whole block."""
    times = RoundTimes()
    first, _ = auto_rounds(monkeypatch, row_s=0.02, plain_s=2.0, times=times)
    assert [event.mode for event in first].count(FALLBACK) == MIN_ROUNDS
    for _ in range(2):
        later, planner = auto_rounds(monkeypatch, row_s=0.02, plain_s=2.0, times=times)
        assert {event.mode for event in later} == {SPECULATIVE}
        assert all(event.width == 16 for event in later[:-1])
        assert planner.observed.scales() == (1.0, 1.0)  # slower alike: no choice changes
    alone, _ = auto_rounds(monkeypatch, row_s=0.02, plain_s=2.0)  # without the engine's times
    assert [event.mode for event in alone].count(FALLBACK) == MIN_ROUNDS


def test_a_generation_starts_re_priced_from_the_rounds_an_earlier_one_timed(monkeypatch):
    """Rows really cost 3 plain steps: the first generation finds out after its first rounds;
    the next one, sharing the engine's RoundTimes, never drafts a whole block."""
    times = RoundTimes()
    first, _ = auto_rounds(monkeypatch, row_s=3.0, times=times)
    assert first[0].mode == SPECULATIVE and first[0].width == 16
    later, planner = auto_rounds(monkeypatch, row_s=3.0, times=times)
    assert SPECULATIVE not in {event.mode for event in later}
    assert planner.observed.scales()[1] > 10


def test_costs_in_no_unit_of_time_are_never_corrected():
    assert ObservedCosts(CHEAP_WIDE).scales() == (1.0, 1.0)  # nothing timed yet
    untimed = RoundCosts(CHEAP_WIDE.seconds)
    planner = make_planner(GenerationParams(block_size=parse_block_size("auto")), 16,
                                       False, [1, 2], untimed)
    assert planner.observed is None


# a noisy calibration's price: every verified row past the anchor as dear as a plain step, so
# auto falls back to plain (a round of width 2 commits 1.9 tokens for 2 steps at acceptance 0.9)
DEAR_WIDE = RoundCosts(tuple(float(w) for w in range(1, 17)), timed=True)


def test_a_noisy_calibration_that_makes_speculation_look_lost_is_probed_sooner(monkeypatch):
    """Rows really cost 0.01 plain steps. Trusted, the calibration keeps auto on plain steps for
    as long as the probe budget says (a probe priced at 2 steps: one per 100 plain steps); marked
    unreliable, auto probes every few plain steps until enough rounds were timed to compare, then
    re-prices and speculates."""
    trusted, _ = auto_rounds(monkeypatch, row_s=0.01, costs=DEAR_WIDE)
    noisy, planner = auto_rounds(monkeypatch, row_s=0.01, costs=replace(DEAR_WIDE, reliable=False))
    checking = ([FALLBACK] * (UNCHECKED_PROBE_EVERY - 1) + [PROBE]) * MIN_ROUNDS
    assert [event.mode for event in noisy[: len(checking)]] == checking
    assert [event.mode for event in trusted[: 2 * len(checking)]] == [FALLBACK] * (2 * len(checking))
    assert noisy[len(checking)].mode == SPECULATIVE  # re-priced from the probes it timed
    wider_scale = planner.observed.scales()[1]  # at most what a timed 2-row round said
    assert wider_scale <= (1.0 + 0.01) / DEAR_WIDE.at(2) + 1e-9
    assert planner.policy.sooner_probe_every is None
    assert len(noisy) < len(trusted)  # the same 120 tokens in fewer rounds
