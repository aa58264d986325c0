"""The speculative loop: prefill, draft, verify, accept, commit. Framework-neutral.

The loop only does bookkeeping over two small interfaces that each framework implements:
a `TargetRunner` (the target with its KV cache and tap collection) and a `Drafter` (the DFlash
model with its context cache). Logits cross the boundary as numpy arrays; taps stay opaque.
Block size 1 (or no drafter) is plain decoding through exactly this code: the honest baseline.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, Protocol

import numpy as np

from dflash_local.acceptance import sample_from, sampled_walk, target_probs
from dflash_local.block_policy import (
    LOOKUP,
    SPECULATIVE,
    BlockPolicy,
    LookupPolicy,
    RoundCosts,
    TreeSizer,
)
from dflash_local.draft_tree import DraftTree
from dflash_local.errors import InvalidRequestError, PromptTooLongError
from dflash_local.events import GenerationParams, StepEvent
from dflash_local.lookup import DEFAULT_MAX_NGRAM, LookupDraft, NgramIndex


class TargetRunner(Protocol):
    """One generation's view of the target: owns its cache, collects the drafter's taps."""

    max_context: int

    def prefill(self, prompt_ids: list[int]) -> tuple[np.ndarray, Any]:
        """Run the prompt. Returns (logits of the last position [V], taps of every prompt row)."""

    def verify(self, block_ids: list[int]) -> np.ndarray:
        """Run W block rows on top of the cache. Returns logits [W, V]."""

    def commit(self, kept_rows: int) -> Any:
        """Keep the first kept_rows rows of the last verify, roll the rest back; return their taps."""

    def join_taps(self, chunks: list[Any]) -> Any:
        """Concatenate tap chunks along the row axis (rows of plain rounds the drafter skipped)."""


class TreeTargetRunner(TargetRunner, Protocol):
    """A runner that can verify a draft tree (draft_tree.py); `supports_tree` says it can now."""

    supports_tree: bool

    def verify_tree(self, anchor_id: int, tree: DraftTree) -> np.ndarray:
        """Run the anchor and the tree's nodes (each at its depth's position, seeing only its
        ancestors) on top of the cache. Returns logits [N+1, V]."""

    def commit_path(self, rows: list[int]) -> Any:
        """Keep these rows of the last verify (ascending, row 0 first) as the next positions,
        drop the rest; return their taps."""


class Drafter(Protocol):
    """One generation's view of the drafter: owns the draft context cache."""

    block_size: int

    def propose(self, anchor_id: int, new_taps: Any, width: int) -> list[int]:
        """Append new_taps to the context, draft the block [anchor, MASK * (width-1)].

        Returns the width-1 argmax proposals for block positions 1..width-1.
        """

    def propose_tree(self, anchor_id: int, new_taps: Any, nodes: int) -> DraftTree:
        """As `propose` with width nodes + 1, but the `nodes` most probable paths (draft_tree.py)."""


def is_tree_round(trees: bool, width: int) -> bool:
    """At a fixed block size, whether a drafter round of this width verifies a tree (one of one
    node is the chain). The calibration times each drafted width this way; under auto the tree
    sizer decides instead, and the block policy prices the whole-block draft it makes."""
    return trees and width > 2


def choose_width(block_size: int, remaining: int) -> int:
    """A round commits at most `width` tokens, so never draft past max_tokens."""
    return max(1, min(block_size, remaining))


def generate(
    runner: TargetRunner,
    drafter: Drafter | None,
    prompt_ids: list[int],
    params: GenerationParams,
    policy: BlockPolicy | None = None,
) -> Iterator[StepEvent]:
    """Yield one StepEvent per round until a stop token or max_tokens. Lossless by construction.

    With params.block_size "auto", `policy` (a fresh one per generation; uncalibrated if None)
    picks each round's width, 1 included (plain fallback), and with params.prompt_lookup a round
    may verify a prompt-lookup draft instead (lookup.py) when that is expected to be faster: the
    taps of rounds without a drafter pass wait in `pending_taps` and reach the drafter, joined,
    with its next block. Drafter rounds verify a draft tree (draft_tree.py) where the runner and
    drafter can, sized by a TreeSizer under "auto" and of width - 1 nodes otherwise.
    Closing the iterator early (a cancelled request) simply stops: the runner and drafter are
    per-generation objects, so nothing is left half-updated for anyone else.
    """
    if not prompt_ids:
        raise InvalidRequestError("the prompt has no tokens")
    if len(prompt_ids) + params.max_tokens > runner.max_context:
        raise PromptTooLongError(
            f"prompt of {len(prompt_ids)} tokens + max_tokens {params.max_tokens} exceeds the "
            f"target's context of {runner.max_context} tokens"
        )
    block_size = _effective_block_size(drafter, params)
    if block_size == 1 or params.block_size != "auto":
        policy = None
    elif policy is None:
        policy = BlockPolicy(RoundCosts.uncalibrated(block_size))
    mode = SPECULATIVE if block_size > 1 else "plain"
    lookup = _lookup_for(policy, params, prompt_ids)
    trees = block_size > 2 and can_tree(runner, drafter, params)
    sizer = TreeSizer(policy.costs) if trees and policy is not None else None
    if sizer is not None:
        policy.whole_block_drafts = True  # each drafter round drafts all it may (below)
    rng = np.random.default_rng(params.seed)
    stop_ids = set(params.stop_token_ids)

    start = time.perf_counter()
    last_logits, new_taps = runner.prefill(prompt_ids)
    anchor_id = _pick(last_logits[None, :], params, rng)
    prefill_s = time.perf_counter() - start
    decode_start = time.perf_counter()
    produced = 1
    finish = "stop" if anchor_id in stop_ids else ("length" if produced >= params.max_tokens else None)
    yield StepEvent(
        token_ids=(anchor_id,), round_index=0, prefill_s=prefill_s,
        prompt_tokens=len(prompt_ids), finish_reason=finish, mode=mode,
    )
    round_index = 0
    pending_taps: list[Any] = []
    while finish is None:
        round_index += 1
        remaining = params.max_tokens - produced
        if policy is not None:
            _price_context(policy, sizer, lookup, len(prompt_ids) + produced)
        proposal = lookup.propose(policy, remaining) if lookup else None
        lookup_draft = lookup.alone(proposal, policy, remaining) if proposal else None
        if lookup_draft is not None:
            width, mode = len(lookup_draft.token_ids) + 1, LOOKUP
        else:
            width, mode = _next_width(policy, block_size, remaining, mode)
        draft_ids: list[int] = []
        tree = None
        grafted: tuple[int, ...] = ()  # a lookup chain riding along in a drafter tree
        drafter_nodes = drafter_depth = 0  # the drafter's own part of the tree
        if block_size > 1:
            pending_taps.append(new_taps)
            if lookup_draft is not None:
                draft_ids = list(lookup_draft.token_ids)
            elif width > 1:
                taps = _joined(runner, pending_taps)
                pending_taps = []
                if sizer is not None:  # auto: draft all it may, verify the best prefix
                    tree = _sized_tree(drafter, anchor_id, taps, sizer, _limit(policy, remaining))
                    drafter_nodes, drafter_depth = len(tree.token_ids), tree.depth
                    if proposal is not None:
                        tree, grafted = lookup.graft(tree, proposal, sizer, _limit(policy, remaining))
                    width = len(tree.token_ids) + 1
                elif is_tree_round(trees, width):
                    tree = drafter.propose_tree(anchor_id, taps, width - 1)
                else:
                    draft_ids = drafter.propose(anchor_id, taps, width)
        drafter_kept = None
        if tree is not None:
            path, kept_ids, next_id, new_taps = _verify_tree(runner, anchor_id, tree, params, rng)
            drafted, depth = len(tree.token_ids), tree.depth
            if sizer is not None:  # judged on its own nodes: grafted ones come after them
                drafter_kept = sum(node <= drafter_nodes for node in path)
                sizer.observe(tree.path_probs, drafter_kept)
        else:
            kept_ids, next_id, new_taps = _verify_chain(runner, anchor_id, draft_ids, params, rng)
            drafted = depth = len(draft_ids)
        accepted_len = len(kept_ids)
        if lookup_draft is not None:
            lookup.policy.observe(lookup_draft.ngram, width, accepted_len)
        elif policy is not None:
            if grafted:
                lookup.policy.observe(proposal.ngram, len(grafted) + 1, _common_start(kept_ids, grafted))
            # a tree is judged by its depth: the positions a kept path could reach; a drafter
            # round by its own nodes alone (what a copy grafted on kept is the lookup's)
            if drafter_kept is None:
                policy.observe(depth + 1, accepted_len)
            else:
                policy.observe(drafter_depth + 1, drafter_kept)
        # the drafter's kept tokens come first on a path; a copy's follow them
        if lookup_draft is not None:
            drafter_accepted = 0
        else:
            drafter_accepted = accepted_len if drafter_kept is None else drafter_kept
        committed = [*kept_ids, next_id]
        committed, finish = _apply_stops(committed, stop_ids)
        if lookup:
            lookup.index.extend(committed)
        produced += len(committed)
        if finish is None and produced >= params.max_tokens:
            finish = "length"
        anchor_id = committed[-1]
        accepted = min(accepted_len, len(committed))
        yield StepEvent(
            token_ids=tuple(committed), drafted=drafted, draft_depth=depth, accepted=accepted,
            copied=max(0, accepted - drafter_accepted), round_index=round_index,
            elapsed_s=time.perf_counter() - decode_start, block_size=width,
            finish_reason=finish, mode=mode,
        )


class _Lookup:
    """The prompt-lookup side of one generation: the n-gram index of its text and the policy
    that prices lookup rounds against the block policy's best choice. A lookup draft either
    makes a round of its own (no drafter pass) or rides along in a drafter round's tree."""

    def __init__(self, prompt_ids: list[int], costs: RoundCosts, max_ngram: int = DEFAULT_MAX_NGRAM):
        self.index = NgramIndex(prompt_ids, max_ngram)
        self.policy = LookupPolicy(costs, max_ngram)

    def propose(self, block_policy: BlockPolicy, remaining: int) -> LookupDraft | None:
        """This round's lookup draft, as long as the round may be; None without a match."""
        self.policy.next_round()
        return self.index.propose(_limit(block_policy, remaining) - 1)

    def alone(self, draft: LookupDraft, block_policy: BlockPolicy, remaining: int) -> LookupDraft | None:
        """The draft cut to its best width when a lookup round of its own is expected to beat
        the block policy's best choice; else None."""
        limit = _limit(block_policy, remaining)
        width, speed = self.policy.plan(draft.ngram, len(draft.token_ids), limit)
        if width < 2 or speed <= block_policy.best_tokens_per_s(limit):
            return None
        return replace(draft, token_ids=draft.token_ids[: width - 1])

    def graft(self, tree: DraftTree, draft: LookupDraft, sizer: TreeSizer, drafted_width: int):
        """(the sized drafter tree with as much of the draft as pays, the grafted tokens)."""
        chain = draft.token_ids[: drafted_width - 1]
        node, shared = tree.held(chain)
        survival = self.policy.survival(draft.ngram, len(chain))
        length = sizer.graft_length(tree.path_probs, drafted_width, survival, shared,
                                    taken=tree.children_mass(node))
        return tree.graft(chain[:length], (node, min(shared, length))), chain[:length]


def _price_context(policy: BlockPolicy, sizer: TreeSizer | None, lookup: _Lookup | None, tokens: int) -> None:
    """Every part that prices rounds prices them at the context the next round runs on."""
    costs = policy.price_context(tokens)
    if sizer is not None:
        sizer.costs = costs
    if lookup is not None:
        lookup.policy.costs = costs


def _limit(block_policy: BlockPolicy, remaining: int) -> int:
    """The widest round allowed now: the policy's widest, never past max_tokens."""
    return max(1, min(block_policy.max_width, remaining))


def _sized_tree(drafter: Drafter, anchor_id: int, taps: Any, sizer: TreeSizer, drafted_width: int) -> DraftTree:
    """Auto's drafter round: a tree as wide as the round may be, cut to the prefix the sizer
    expects to make the most tokens per second."""
    tree = drafter.propose_tree(anchor_id, taps, drafted_width - 1)
    return tree.prefix(sizer.size(tree.path_probs, drafted_width))


def _common_start(kept: list[int], chain: tuple[int, ...]) -> int:
    """How many of the chain's first tokens the round kept."""
    count = 0
    for token, wanted in zip(kept, chain):
        if token != wanted:
            break
        count += 1
    return count


def _verify_tree(runner: TreeTargetRunner, anchor_id: int, tree: DraftTree,
                 params: GenerationParams, rng: np.random.Generator):
    """(the kept path's nodes, their drafts, the target's next token, the kept rows' taps)."""
    logits = runner.verify_tree(anchor_id, tree)
    path, next_id = _walk(tree, logits, params, rng)
    new_taps = runner.commit_path([0, *path])
    return path, [tree.token_ids[node - 1] for node in path], next_id, new_taps


def _verify_chain(runner: TargetRunner, anchor_id: int, draft_ids: list[int],
                  params: GenerationParams, rng: np.random.Generator):
    """The same for a chain (a plain step when there are no drafts)."""
    logits = runner.verify([anchor_id, *draft_ids])
    path, next_id = _walk(DraftTree.chain(draft_ids), logits, params, rng)
    return draft_ids[: len(path)], next_id, runner.commit(len(path) + 1)


def _walk(tree: DraftTree, logits: np.ndarray, params: GenerationParams, rng: np.random.Generator):
    """(the kept path, the next token) by the greedy or the sampled rule (acceptance.py)."""
    if params.greedy:
        return tree.walk(np.argmax(logits, axis=-1))
    # only the rows the walk reaches are turned into probabilities
    return sampled_walk(tree, lambda row: target_probs(logits[row : row + 1], params)[0], rng)


def _lookup_for(policy: BlockPolicy | None, params: GenerationParams, prompt_ids: list[int]):
    """Lookup rounds need the auto policy (it prices them); fixed widths stay pure DFlash."""
    if policy is None or not params.prompt_lookup:
        return None
    return _Lookup(prompt_ids, policy.costs)


def can_tree(runner: TargetRunner, drafter: Drafter | None, params: GenerationParams) -> bool:
    """Trees when both sides can and the request does not ask for chains."""
    return (params.tree and getattr(runner, "supports_tree", False)
            and hasattr(drafter, "propose_tree"))


def _effective_block_size(drafter: Drafter | None, params: GenerationParams) -> int:
    if drafter is None or not params.speculative:
        return 1
    if params.block_size is None or params.block_size == "auto":
        return drafter.block_size
    # a drafter can run with a smaller block than it was trained with, never a larger one
    return min(params.block_size, drafter.block_size)


def _next_width(policy: BlockPolicy | None, block_size: int, remaining: int, mode: str):
    if policy is None:
        return choose_width(block_size, remaining), mode
    choice = policy.choose(remaining)
    return choice.width, choice.mode


def _joined(runner: TargetRunner, tap_chunks: list[Any]) -> Any:
    return tap_chunks[0] if len(tap_chunks) == 1 else runner.join_taps(tap_chunks)


def _pick(logits: np.ndarray, params: GenerationParams, rng: np.random.Generator) -> int:
    if params.greedy:
        return int(np.argmax(logits[-1]))
    return sample_from(target_probs(logits[-1:], params)[0], rng)


def _apply_stops(committed: list[int], stop_ids: set[int]) -> tuple[list[int], str | None]:
    for index, token_id in enumerate(committed):
        if token_id in stop_ids:
            return committed[: index + 1], "stop"
    return committed, None
