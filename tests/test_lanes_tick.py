"""The order of one tick (service/lanes.py), with generations reduced to the calls their loop
makes through the lanes: a newcomer admitted mid-tick runs its prefill after the running
lanes' proposal batch and before their verify batch, so its first token waits for one batch."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from dflash_local.service.lanes import Lanes


class Runner:
    """No verify_batch: the lanes verify one runner after another, each call logged."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def verify(self, anchor_id, tree):
        self.log.append(("verify", self.name))
        return np.zeros((len(tree.token_ids) + 1, 4))


class Drafter:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def propose(self, anchor_id, new_taps, size):
        self.log.append(("propose", self.name))
        return [1] * size


def generation(lanes: Lanes, name: str, log: list, rounds: int):
    """A stream's calls: one prefill chunk, then rounds of a 2-wide draft and its verify."""
    runner, drafter = Runner(name, log), Drafter(name, log)

    def run():
        log.append(("prefill", name))
        for _ in range(rounds):
            draft = lanes.propose(drafter, 0, None, 2, tree=False)
            lanes.verify(runner, 0, SimpleNamespace(token_ids=draft))

    return lanes.lane(SimpleNamespace(cancelled=False), run)


def test_a_newcomer_prefills_between_the_proposals_and_the_verifies():
    lanes, log = Lanes(), []
    running = [generation(lanes, name, log, rounds=5) for name in ("a", "b")]
    for _ in range(2):  # one prefill chunk a tick: a, then b
        lanes.tick(running)
    assert [entry for entry in log if entry[0] == "prefill"] == [("prefill", "a"), ("prefill", "b")]
    newcomer = generation(lanes, "c", log, rounds=1)
    del log[:]
    lanes.tick(running, admit=lambda: [newcomer])
    assert log == [("propose", "a"), ("propose", "b"), ("prefill", "c"), ("verify", "a"), ("verify", "b")]
    assert lanes.in_flight() == 3
    del log[:]
    lanes.tick([*running, newcomer])  # from the next tick it drafts and verifies with the others
    assert log == [("propose", "a"), ("propose", "b"), ("propose", "c"),
                   ("verify", "a"), ("verify", "b"), ("verify", "c")]
