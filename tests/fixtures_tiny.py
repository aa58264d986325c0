"""Session-cached tiny pairs on disk, engines over them, and scripted drafters.

Test modules wrap these in their own session fixtures (tests/conftest.py belongs to others):
a pair is built once per session whichever module asks first.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import tiny_models
import torch

from dflash_local.events import GenerationParams, parse_block_size
from dflash_local.method.draft_tree import DraftTree

# Tiny models gain nothing from intra-op threads, and on a shared 2-core machine two threads
# make each small matmul wait for a busy core: one thread was ~30x faster under load here.
torch.set_num_threads(1)

def params_of(**fields) -> GenerationParams:
    """GenerationParams with block_size given as a request gives it (an int, "auto" or None)."""
    if "block_size" in fields:
        fields["block_size"] = parse_block_size(fields["block_size"])
    return GenerationParams(**fields)


def use_policy(monkeypatch, make: Callable) -> None:
    """Auto planners build their width policy with `make(max_width, whole_block_drafts)`: a
    test's own costs, prior and probing, whatever the engine's calibration says."""
    from dflash_local.method.planning import auto

    monkeypatch.setattr(auto, "BlockPolicy", lambda _costs, _prior, *, max_width, whole_block_drafts:
                        make(max_width, whole_block_drafts))


_PAIRS: dict[tuple, Pair] = {}
_ENGINES: dict[tuple, object] = {}


@dataclass(frozen=True)
class Pair:
    target: Path
    drafter: Path


def tiny_pair(tmp_path_factory, family: str = "qwen3", block_size: int = 16,
              **drafter_kwargs) -> Pair:
    """A random target of `family` and a z-lab-format drafter for it, written once per session."""
    key = (family, block_size, json.dumps(drafter_kwargs, sort_keys=True))
    if key not in _PAIRS:
        root = tmp_path_factory.mktemp(f"pair-{family}-b{block_size}")
        target = tiny_models.make_target(root / "target", family=family)
        drafter = tiny_models.make_drafter(root / "drafter", target, block_size=block_size,
                                           **drafter_kwargs)
        _PAIRS[key] = Pair(target, drafter)
    return _PAIRS[key]


def tiny_engine(pair: Pair, with_drafter: bool = True):
    """A TorchEngine (float32, CPU) over the pair; engines hold no per-generation state."""
    from dflash_local.engines.torch_engine import TorchEngine

    key = (pair, with_drafter)
    if key not in _ENGINES:
        _ENGINES[key] = TorchEngine(pair.target, pair.drafter if with_drafter else None)
    return _ENGINES[key]


def collect(events) -> tuple[list[int], list]:
    """All committed token ids of a stream, and its events."""
    events = list(events)
    return [token for event in events for token in event.token_ids], events


# (context tokens + [anchor], number of drafts wanted) -> draft ids
Script = Callable[[list[int], int], list[int]]


class ScriptedDrafter:
    """An `interfaces.Drafter` whose proposals come from a script, for cases a random pair cannot
    produce on demand (all accepted, none accepted, exactly k accepted).

    It rebuilds the committed sequence from what the loop hands it: the prompt's taps first,
    then each round the taps of [previous anchor, accepted drafts] (the length is always right;
    the tokens are its own block's, not a lookup chain's that a round kept instead: the scripts
    here look at the length only). An `inner` real drafter, if
    given, still runs every round so its cache goes through the same path.
    """

    tree_drafts = False  # ScriptedTreeDrafter drafts trees

    def __init__(self, prompt_ids: list[int], script: Script, drafter_block: int = 16, inner=None):
        self.prompt_ids = list(prompt_ids)
        self.script = script
        self.drafter_block = drafter_block
        self.inner = inner
        self.context: list[int] = []
        self._last_block: list[int] | None = None
        self.accepted_seen: list[int] = []  # drafts accepted in each previous round

    def propose(self, anchor_id: int, new_taps, width: int) -> list[int]:
        self._take(new_taps)
        if self.inner is not None:
            self.inner.propose(anchor_id, new_taps, width)
        drafts = list(self.script(self.context + [anchor_id], width - 1))
        assert len(drafts) == width - 1
        self._last_block = [anchor_id, *drafts]
        return drafts

    def _take(self, new_taps) -> None:
        """Extend the context by the rows the target committed since the last block."""
        rows = new_taps.shape[1]
        if self._last_block is None:
            assert rows == len(self.prompt_ids), (rows, len(self.prompt_ids))
            self.context.extend(self.prompt_ids)
        else:
            self.context.extend(self._last_block[:rows])
            self.accepted_seen.append(rows - 1)


class ScriptedTreeDrafter(ScriptedDrafter):
    """Trees whose right path is never the first branch, so a kept path is never a prefix of the
    verified rows: node 1 is a wrong token; node 2 starts the script's drafts (`follow`), a chain
    of `chain` nodes under the anchor; the rest are wrong siblings along that chain."""

    def __init__(self, prompt_ids, script: Script, chain: int, drafter_block: int = 16, inner=None,
                 vocab: int = tiny_models.VOCAB):
        super().__init__(prompt_ids, script, drafter_block, inner)
        self.tree_drafts = True
        self.chain, self.vocab = chain, vocab

    def propose_tree(self, anchor_id: int, new_taps, nodes: int) -> DraftTree:
        self._take(new_taps)
        if self.inner is not None:
            self.inner.propose_tree(anchor_id, new_taps, nodes)
        length = min(self.chain, nodes - 1)
        if length < 1:  # one node (two tokens left under auto): the script's first draft
            drafts = list(self.script(self.context + [anchor_id], 1))
            self._last_block = [anchor_id, *drafts]
            return DraftTree(tuple(drafts), (0,), (0.9,))
        drafts = list(self.script(self.context + [anchor_id], length))
        tokens = [(drafts[0] + 1) % self.vocab, *drafts]
        parents = [0, 0, *range(2, length + 1)]
        for node in range(2, 2 + length):  # a wrong sibling after each chain node, while room
            if len(tokens) >= nodes or node - 1 >= length:
                break
            tokens.append((drafts[node - 1] + 2) % self.vocab)
            parents.append(node)
        self._last_block = [anchor_id, *drafts]
        probs = tuple(0.9 ** i for i in range(1, len(tokens) + 1))
        return DraftTree(tuple(tokens), tuple(parents), probs)


def follow(continuation: list[int], prompt_len: int, right: int | None = None,
           vocab: int = tiny_models.VOCAB) -> Script:
    """A script that proposes `continuation` (the plain output) for the first `right` drafts of
    each block and a wrong token after (None = always right, 0 = always wrong)."""

    def script(sequence: list[int], count: int) -> list[int]:
        start = len(sequence) - prompt_len  # index in the output of the first draft
        padded = continuation + [0] * (start + count)
        truth = padded[start : start + count]
        keep = count if right is None else right
        return truth[:keep] + [(token + 1) % vocab for token in truth[keep:]]

    return script


class ReferenceDrafter:
    """Wraps a real drafter (joined taps go through its cache) and proposes the known plain
    output where `right(anchor_index, offset)` says so, a wrong token elsewhere. It finds its
    place by counting the tap rows it was handed, so a missing or extra row fails loudly; rounds
    it did not draft (plain, lookup) reach it as joined taps with its next block."""

    tree_drafts = False

    def __init__(self, inner, prompt_len: int, reference: list[int],
                 right: Callable[[int, int], bool]):
        self.inner, self.prompt_len, self.reference, self.right = inner, prompt_len, reference, right
        self.drafter_block = inner.drafter_block
        self.rows = 0

    def propose(self, anchor_id, new_taps, width):
        self.inner.propose(anchor_id, new_taps, width)
        self.rows += new_taps.shape[1]
        index = self.rows - self.prompt_len  # output index of the anchor
        assert self.reference[index] == anchor_id, "the taps do not cover the committed rows"
        drafts = []
        for offset, position in enumerate(range(index + 1, index + width)):
            truth = self.reference[position] if position < len(self.reference) else 0
            drafts.append(truth if self.right(index, offset) else (truth + 1) % tiny_models.VOCAB)
        return drafts
