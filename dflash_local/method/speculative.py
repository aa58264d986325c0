"""The speculative loop: the method on one screen. Framework-neutral.

One round is plan -> propose -> verify -> accept -> commit:
- plan: the planner (planning/) chooses a proposer and its width;
- propose: the proposer (proposers.py) makes a DraftTree: the drafter's chain or tree, a
  prompt-lookup draft, or both; a plain step is the empty tree;
- verify: the target runs the anchor and every node in one pass (`TargetRunner.verify`);
- accept: the longest path the target agrees with, plus one token of its own (greedy:
  DraftTree.walk; sampling: acceptance.sampled_walk, exact rejection sampling);
- commit: the runner keeps the path's rows and rolls the rest back; their taps feed the drafter.
Each framework implements the runner and the drafter (interfaces.py). Output is exactly what
the target alone would produce: greedy the same tokens, sampling the same distribution.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from dflash_local.errors import InvalidRequestError, PromptTooLongError
from dflash_local.events import GenerationParams, StepEvent, widest_block
from dflash_local.method.acceptance import sample_from, sampled_walk, target_probs
from dflash_local.method.constraint import Grammar, make_guide
from dflash_local.method.draft_tree import DraftTree
from dflash_local.method.interfaces import Drafter, TargetRunner
from dflash_local.method.logprobs import token_logprobs
from dflash_local.method.planning.costs import RoundCosts
from dflash_local.method.planning.observed import RoundTimes
from dflash_local.method.planning.planner import Planner, make_planner
from dflash_local.method.prefix_cache import Resume
from dflash_local.method.proposers import Draft, DraftSources
from dflash_local.method.round_trace import STEPS, RoundTrace


def generate(runner: TargetRunner, drafter: Drafter | None, prompt_ids: list[int],
             params: GenerationParams, planner: Planner | None = None, resume: Resume | None = None,
             trace: RoundTrace | None = None, grammar: Grammar | None = None,
             timer: Callable[[], float] | None = None) -> Iterator[StepEvent]:
    """Yield one StepEvent per round until a stop token or max_tokens. `planner`: a fresh one
    per generation (planning/planner.py: make_planner; None: the one params ask for, uncalibrated).
    `resume`: the prompt's first rows are already in the runner's cache (a kept prefix,
    prefix_cache.py), and who keeps the state when the generation ends. Closing the iterator
    early (a cancelled request) simply stops: the runner and drafter are per-generation objects.
    Ended between rounds (finished, or closed at a yield), the state is whole and `resume.keep`
    gets it; a prefill or a round cut short by an error leaves nothing to keep. `trace`:
    round_trace.py; `grammar`: constraint.py. prefill_s, elapsed_s: wall time (the client waited);
    round costs: on `timer` (shared: its own time, shared_rounds.py; None: the wall clock)."""
    _check_room(runner, prompt_ids, params)
    planner = planner or default_planner(runner, drafter, prompt_ids, params)
    resume, timer = resume or Resume(), timer or time.perf_counter
    rng, guide = np.random.default_rng(params.seed), make_guide(grammar, params, drafter)
    sources, start = DraftSources(drafter, runner, resume.unseen_taps), time.perf_counter()
    last_logits, taps = runner.prefill(prompt_ids, resume.cached_rows)
    last_logits = guide.mask(last_logits[None])  # [1, V]
    rows = list(prompt_ids)  # the ids of the rows in the runner's cache, in order
    anchor_id = _pick(last_logits[0], params, rng)
    produced, decode_start = 1, time.perf_counter()
    finish = guide.commit(*_finish([anchor_id], produced, params))[1]
    whole = True  # the runner, the drafter and `taps` agree with `rows`
    try:
        yield StepEvent(token_ids=(anchor_id,), prefill_s=decode_start - start,
                        finish_reason=finish, prompt_tokens=len(prompt_ids),
                        cached_tokens=resume.cached_rows, cached_tier=resume.cached_tier,
                        mode=planner.mode, logprobs=_logprobs(last_logits, [0], [anchor_id], params))
        if resume.keep_prompt and resume.keep is not None:  # a turn's end: a state that
            sources.add_taps(taps)  # cannot be trimmed is kept where the prompt ends too
            taps = sources.unseen()
            resume.keep(list(rows), taps)
        round_index = 0
        while finish is None:
            whole, round_index = False, round_index + 1
            sources.add_taps(taps)
            clock, context = _Clock(timer), len(prompt_ids) + produced
            proposer = _lap(clock, planner.plan(context, params.max_tokens - produced))  # plan
            draft = _lap(clock, guide.shape(proposer.propose(sources, anchor_id)))  # propose
            logits = _lap(clock, guide.mask(runner.verify(anchor_id, draft.tree)))  # verify
            path, next_id = _lap(clock, _accept(draft.tree, logits, params, rng))  # accept
            taps = _lap(clock, runner.commit([0, *path]))  # commit
            kept = draft.kept_ids(path)
            rows += [anchor_id, *kept]
            whole = True
            committed, finish = guide.commit(*_finish([*kept, next_id], produced + len(path) + 1, params))
            _lap(clock, planner.observe(draft, path, committed, clock[-1] - clock[1]))
            produced += len(committed)
            anchor_id = committed[-1]
            yield _round_event(draft, path, committed, round_index=round_index,
                               finish_reason=finish, elapsed_s=time.perf_counter() - decode_start,
                               logprobs=_logprobs(logits, [0, *path], committed, params))
            if trace is not None:  # the consumer's time since the event is the round's emit_s
                trace.round(_round_record(planner, draft, path, committed, context, clock))
    finally:
        if whole and resume.keep is not None:
            sources.add_taps(taps)
            resume.keep(rows, sources.unseen())


def default_planner(runner: TargetRunner, drafter: Drafter | None, prompt_ids: list[int],
                    params: GenerationParams, costs: RoundCosts | None = None,
                    prior: Sequence[float] = (), times: RoundTimes | None = None,
                    lanes: Callable[[], int] | None = None) -> Planner:
    """The planner params ask for, over this runner and drafter (`costs`, `prior`: a calibration;
    `times`: the rounds earlier generations timed against it, planning/observed.py; `lanes`: how
    many generations' rounds are batched now, for auto's prices)."""
    widest = widest_block(params, drafter.drafter_block if drafter is not None else None)
    trees = params.tree and runner.supports_tree and drafter is not None and drafter.tree_drafts
    return make_planner(params, widest, trees, prompt_ids, costs, prior, times, lanes)


class _Clock(list):
    """A round's start, then each step's end, on `timer`."""

    def __init__(self, timer: Callable[[], float]):
        super().__init__([timer()])
        self.timer = timer


def _lap(clock: _Clock, value):
    """`value`, once its step's end is on the clock."""
    clock.append(clock.timer())
    return value


def _round_record(planner: Planner, draft, path: list[int], committed: list[int], context: int,
                  clock: _Clock) -> dict:
    """A round as round_trace.py writes it; `clock`: the end of each step, from the plan's start
    (the last one, now)."""
    _lap(clock, None)
    priced_s, expected_tokens = planner.priced(draft)
    steps = dict(zip(STEPS, (end - start for start, end in itertools.pairwise(clock))))
    return {"mode": draft.mode, "rows": len(draft.tree.token_ids) + 1, "kept": len(path),
            "committed": len(committed), "context": context, "priced_s": priced_s,
            "expected_tokens": expected_tokens, **steps}


def _check_room(runner: TargetRunner, prompt_ids: list[int], params: GenerationParams) -> None:
    if not prompt_ids:
        raise InvalidRequestError("the prompt has no tokens")
    if len(prompt_ids) + params.max_tokens > runner.max_context:
        raise PromptTooLongError(
            f"prompt of {len(prompt_ids)} tokens + max_tokens {params.max_tokens} exceeds the "
            f"target's context of {runner.max_context} tokens")


def _accept(tree: DraftTree, logits: np.ndarray, params: GenerationParams, rng: np.random.Generator):
    """(the kept path's nodes, the target's next token) by the greedy or the sampled rule."""
    if params.greedy:
        return tree.walk(np.argmax(logits, axis=-1))
    # only the rows the walk reaches are turned into probabilities
    return sampled_walk(tree, lambda row: target_probs(logits[row : row + 1], params)[0], rng)


def _round_event(draft: Draft, path: list[int], committed: list[int], **fields) -> StepEvent:
    """What a round drafted and kept: `path`, the kept nodes; `committed`, their tokens and the
    target's own, cut at a stop token or max_tokens."""
    accepted = min(len(path), len(committed))
    drafted = len(draft.tree.token_ids)
    return StepEvent(token_ids=tuple(committed), drafted=drafted, mode=draft.mode,
                     draft_depth=draft.tree.depth, accepted=accepted, width=drafted + 1,
                     lookup_accepted=max(0, accepted - draft.drafter_kept(path)), **fields)


def _logprobs(logits: np.ndarray, rows: list[int], committed: list[int], params: GenerationParams):
    """Each committed token's logprob where the request asks: row rows[i] predicted committed[i]."""
    if params.logprobs is None:
        return ()
    return token_logprobs(logits, rows[: len(committed)], committed, params.logprobs)


def _pick(logits: np.ndarray, params: GenerationParams, rng: np.random.Generator) -> int:
    if params.greedy:
        return int(np.argmax(logits))
    return sample_from(target_probs(logits[None, :], params)[0], rng)


def _finish(committed: list[int], produced: int, params: GenerationParams):
    """(the tokens up to and with the first stop token, "stop" | "length" | None); `produced`
    counts every token so far, these included."""
    for index, token_id in enumerate(committed):
        if token_id in params.stop_token_ids:
            return committed[: index + 1], "stop"
    return committed, "length" if produced >= params.max_tokens else None
