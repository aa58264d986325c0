"""A constraint on the reply (a JSON Schema, a regex, a grammar) in the speculative loop: a
collaborator of the proposer and the acceptance step, not a kind of round. Numpy only; a grammar
engine enters as a `Grammar` (dflash_local/constraints/ adapts llguidance).

Each round, `Guide`:
- shape (before the verify): the grammar walks the draft tree depth first, advanced along each
  path and rolled back after it; a node whose token its parent row forbids is pruned with its
  subtree (rows not paid for), and each kept row's mask is noted. The tokens the grammar forces
  after the tree's first path are grafted on as a free draft, as a lookup chain is;
- mask (after the verify): every row's logits outside its mask become -inf, so greedy takes
  the masked argmax and sampling draws from the target's probabilities masked, then
  renormalised: the rule constrained plain decoding applies to every token, so the output is
  the same token for token (greedy) and in distribution (sampling);
- commit: the grammar consumes the committed tokens.
A stop token is allowed only where the text so far is a whole match. A row where the grammar
admits nothing allows the stop tokens alone, and the reply ends with finish reason
DEAD_END: never a hang, never a row without a token.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

import numpy as np

from dflash_local.errors import InvalidRequestError
from dflash_local.events import GenerationParams, widest_block
from dflash_local.method.draft_tree import DraftTree
from dflash_local.method.proposers import Draft

DEAD_END = "constraint"  # the finish reason of a reply the grammar could not continue


class Grammar(Protocol):
    """One generation's matcher: the text so far, as tokens, and what may follow."""

    busy_s: float  # seconds spent on it, its masks applied included (the Guide adds them)

    def allowed(self) -> np.ndarray:
        """bool [tokenizer vocab]: the tokens it admits next, stop tokens left out."""

    def complete(self) -> bool:
        """The tokens so far are a whole match: the reply may end here."""

    def consume(self, token_id: int) -> None:
        """Advance by one token that `allowed` admits."""

    def rollback(self, count: int) -> None:
        """Undo the last `count` consumed tokens."""

    def forced(self) -> list[int]:
        """The tokens it forces next (the only spelling it allows; may be empty)."""


def make_guide(grammar: Grammar | None, params: GenerationParams, drafter) -> Guide | Unconstrained:
    """The loop's guide: a speculative generation grafts up to a drafter block of forced tokens
    a round; plain decoding (width 1) none, so it stays the plain baseline."""
    if grammar is None:
        return Unconstrained()
    widest = widest_block(params, drafter.drafter_block if drafter is not None else None)
    return Guide(grammar, params.stop_token_ids, widest - 1, params.max_tokens)


class Unconstrained:
    """The loop's guide where a request has no constraint: it changes nothing."""

    def shape(self, draft: Draft) -> Draft:
        return draft

    def mask(self, logits: np.ndarray) -> np.ndarray:
        return logits

    def commit(self, token_ids: list[int], finish: str | None) -> tuple[list[int], str | None]:
        return token_ids, finish


class Guide:
    """A grammar in the loop (the module docstring). `stop_ids`: the tokens that end a reply;
    `free_draft`: the most forced tokens a round grafts on (0: none, as plain decoding);
    `max_tokens`: the reply's limit (a round's tree stays within what is left)."""

    def __init__(self, grammar: Grammar, stop_ids: Sequence[int], free_draft: int, max_tokens: int):
        stop_ids = [int(token) for token in stop_ids if token >= 0]  # -1: "never stops"
        if not stop_ids:
            raise InvalidRequestError("a constrained reply needs a stop token to end it")
        self.grammar, self.stop_ids, self.free_draft = grammar, np.asarray(stop_ids), free_draft
        self._stop_set, self._stop_width = frozenset(stop_ids), max(stop_ids) + 1
        self.remaining = max_tokens  # tokens the reply may still commit
        self._rows: list[np.ndarray] | None = None  # each row's mask for the next `mask`

    def shape(self, draft: Draft) -> Draft:
        """`draft` without the nodes the grammar forbids, the forced tokens after its first
        path grafted on; one less deep than the tokens left (a round commits one more)."""
        return self._timed(self._shape, draft)

    def _shape(self, draft: Draft) -> Draft:
        tree, rows = draft.tree, {}
        self._visit(tree, 0, self.remaining - 1, rows)
        kept = sorted(rows)  # old node numbers, parents before children as in `tree`
        renumber = {old: new for new, old in enumerate(kept)}
        probs = tuple(tree.path_probs[old - 1] for old in kept[1:]) if tree.path_probs else ()
        pruned = DraftTree(tuple(tree.token_ids[old - 1] for old in kept[1:]),
                           tuple(renumber[tree.parents[old - 1]] for old in kept[1:]), probs)
        self._rows = [rows[old] for old in kept]
        drafter_nodes = sum(0 < old <= draft.drafter_nodes for old in kept)
        return replace(draft, tree=self._graft_forced(pruned, self.remaining - 1),
                       drafter_nodes=drafter_nodes)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """logits [rows, V] of the last shaped tree's rows (or the next token's alone), with
        what the grammar forbids at -inf."""
        return self._timed(self._masked, logits)

    def commit(self, token_ids: list[int], finish: str | None) -> tuple[list[int], str | None]:
        """The round's committed tokens (up to a stop token, which ends the reply) and the
        loop's finish reason, returned with the reason DEAD_END where the reply stopped at a
        row that the grammar left without a token."""
        return self._timed(self._commit, token_ids, finish)

    def _commit(self, token_ids: list[int], finish: str | None) -> tuple[list[int], str | None]:
        self._rows = None
        self.remaining -= len(token_ids)
        for token_id in token_ids:
            if token_id in self._stop_set:
                return token_ids, finish if self.grammar.complete() else DEAD_END
            self.grammar.consume(int(token_id))
        return token_ids, finish

    def _masked(self, logits: np.ndarray) -> np.ndarray:
        rows = self._rows if self._rows is not None else [self._row_mask()]
        masked = logits.copy()
        masked[len(rows):] = -np.inf
        for index, row in enumerate(rows):
            _mask_row(masked[index], row)
        return masked

    def _visit(self, tree: DraftTree, node: int, depth_limit: int, rows: dict) -> None:
        """Note `node`'s row mask (the grammar holds its path) and visit the children it
        admits, each consumed and rolled back."""
        rows[node] = row = self._row_mask()
        if tree.depths[node] >= depth_limit:
            return
        for token, child in tree.children_of(node):
            if not _admits(row, token):
                continue
            if token in self._stop_set:  # the reply ends there: nothing below it is verified
                rows[child] = self._stop_row(len(row))
                continue
            self.grammar.consume(token)
            self._visit(tree, child, depth_limit, rows)
            self.grammar.rollback(1)

    def _graft_forced(self, tree: DraftTree, depth_limit: int) -> DraftTree:
        """`tree` with the tokens forced after its first path grafted on (at most free_draft,
        and `depth_limit` deep), their rows' masks noted."""
        node, path = 0, []
        while tree.children_of(node) and self.free_draft:
            token, node = tree.children_of(node)[0]
            path.append(token)
        if not self.free_draft or not self._stop_set.isdisjoint(path):
            return tree
        for token in path:
            self.grammar.consume(token)
        room = min(self.free_draft, depth_limit - len(path))
        forced, row = [], self._rows[node]
        for token in self.grammar.forced()[: max(room, 0)]:
            if not _admits(row, token) or token in self._stop_set:
                break
            self.grammar.consume(token)
            forced.append(token)
            row = self._row_mask()
            self._rows.append(row)
        self.grammar.rollback(len(path) + len(forced))
        return tree.graft([*path, *forced]) if forced else tree

    def _row_mask(self) -> np.ndarray:
        """The next token's mask where the grammar is now: stop tokens where it is complete,
        and alone where it admits nothing."""
        allowed = self.grammar.allowed()
        if len(allowed) < self._stop_width:
            allowed = np.pad(allowed, (0, self._stop_width - len(allowed)))
        complete = self.grammar.complete()
        allowed[self.stop_ids] = complete
        if not complete and not allowed.any():
            allowed[self.stop_ids] = True
        return allowed

    def _stop_row(self, width: int) -> np.ndarray:
        """The row after a stop token: the reply has ended, any stop token will do."""
        row = np.zeros(max(width, self._stop_width), dtype=bool)
        row[self.stop_ids] = True
        return row

    def _timed(self, step, *args):
        """step(*args), its time on the grammar's clock: the constraint's overhead."""
        start = time.perf_counter()
        try:
            return step(*args)
        finally:
            self.grammar.busy_s += time.perf_counter() - start


def _admits(row: np.ndarray, token: int) -> bool:
    return 0 <= token < len(row) and bool(row[token])


def _mask_row(logits_row: np.ndarray, allowed: np.ndarray) -> None:
    """logits_row [V] with what `allowed` (bool, any length) does not admit at -inf, in place.
    Written through the shorter index list, the admitted tokens or the forbidden ones: a
    schema's punctuation admits a few, a string's contents nearly all."""
    width = min(len(allowed), len(logits_row))
    allowed = allowed[:width]
    logits_row[width:] = -np.inf
    if 2 * np.count_nonzero(allowed) < width:
        admitted = np.flatnonzero(allowed)
        kept = logits_row[admitted]
        logits_row[:width] = -np.inf
        logits_row[admitted] = kept
    else:
        logits_row[np.flatnonzero(~allowed)] = -np.inf
