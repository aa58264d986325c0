"""Adaptation while idle: the loaded pair's drafter learns its recorded replies in slices the
worker runs when no job waits or runs (service/worker.py `IdleWork`), and a candidate serves only
when it drafts better than the one serving on the most recent replies, held out from training.

Boundary: the round's order and the decisions (when a round starts, which replies train and which
judge, whether a candidate serves); the tensors are adapt/trainer.py's (torch, imported when
adaptation is built), the files adapt/versions.py's, the swap the engine's (`swap_drafter`).

A round, one slice per line: the target's taps of each reply not yet tapped, a chunk of rows at a
time; a few sequences of the shipped drafter's own data, where it ships (replay); training steps;
teacher-forced acceptance of the candidate, the serving drafter and the shipped one on the held-out
replies, a chunk of blocks at a time; then, when the candidate wins by the margin
(`better_by_margin`), it is written as a new version and swapped in. Each kind of slice is sized
from the ones before it to stay under the budget (`SliceSizer`).
"""

from __future__ import annotations

import logging
import math
import random
import statistics
import threading
import time
from collections import deque
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, ClassVar

from dflash_local.adapt.record import ReplyRecorder
from dflash_local.adapt.store import RecordedReply, ReplyStore
from dflash_local.adapt.versions import VersionStore, now_iso
from dflash_local.engines.drafter_swap import swap_drafter
from dflash_local.errors import CheckpointError, DFlashError, check_fields

log = logging.getLogger("dflash_local.adapt")
# tests/conftest.py turns it off: a test's replies start no rounds unless the test asks
TRAIN_WHILE_IDLE = True


@dataclass(frozen=True)
class RoundSettings:
    min_new_replies: int = 4  # a round starts once this many replies are new
    held_out: int = 8  # at most this many of the newest replies judge, never train
    min_held_out: int = 2
    # with AdaptSettings.lr, after 48 replies: held-out τ of the kind 1.17x, general 0.96x (4 steps:
    # 1.09x, 0.98x); after 100: 1.16x, 0.93x (docs/records/adapt-tune-100-replies.json)
    steps_per_new_reply: int = 16
    max_steps: int = 64
    max_tapped: int = 64  # sequences kept with their taps, newest first (~2 MiB each here)
    score_anchors: int = 32  # blocks judged per held-out reply
    replay_per_round: int = 4  # shipped-data sequences tapped per round, up to replay_pool
    replay_pool: int = 32
    slice_budget_s: float = 0.2

    def __post_init__(self):
        at_least = {name: (lambda value, low=low: isinstance(value, int) and value >= low, f"an int >= {low}")
                    for name, low in (("min_new_replies", 1), ("min_held_out", 1), ("steps_per_new_reply", 1),
                                      ("max_steps", 1), ("score_anchors", 1), ("replay_per_round", 0),
                                      ("replay_pool", 0))}
        check_fields(self, {
            **at_least,
            "held_out": (lambda value: isinstance(value, int) and value >= self.min_held_out,
                         f"an int >= min_held_out ({self.min_held_out})"),
            "max_tapped": (lambda value: isinstance(value, int) and value > self.held_out,
                           f"an int > held_out ({self.held_out}): some tapped replies must train"),
            "slice_budget_s": (lambda value: 0 < value < math.inf, "a number of seconds > 0")})


def disabled_status(recording: bool = False, note: str | None = None) -> dict:
    """/dflash/status's `adapt` where nothing adapts (served engines, serve --no-adapt)."""
    return {"enabled": False, "recording": recording, "replies": 0, "pending": 0, "training": False,
            "version": None, "trained_on": 0, "tau_recent": {"shipped": None, "serving": None},
            "last_round": None, "history": [], "note": note}


def tau(accepted: list[int]) -> float | None:
    return None if not accepted else 1 + statistics.fmean(accepted)


def better_by_margin(candidate: list[int], serving: list[int], relative: float = 0.02) -> bool:
    """Whether the candidate drafts better, block for block on the same held-out blocks: its mean
    gain in accepted drafts is over two standard errors of the paired differences (a swap on noise
    at most ~2.5% of the time, blocks taken as independent) and at least `relative` of the serving
    τ (a version is a write and a swap: not for a gain no one would measure)."""
    if len(candidate) != len(serving) or len(candidate) < 2:
        return False
    gains = [c - s for c, s in zip(candidate, serving)]
    mean = statistics.fmean(gains)
    error = statistics.stdev(gains) / math.sqrt(len(gains))
    return mean > 2 * error and mean >= relative * tau(serving)


PUBLISH, RESTART, TRAIN_ON = "publish", "restart", "train on"


def verdict(candidate: list[int], serving: list[int]) -> str:
    """What a round's scores decide: PUBLISH a candidate better by the margin; RESTART one the
    serving drafter beats by the same margin (it went astray: it starts again from what serves);
    else TRAIN_ON, the candidate kept as it is: a gain inside the noise of one round's held-out
    blocks carries on into the next round (restarting on every dip threw away the rounds' work:
    12 restarts in 25 rounds of ShareGPT coding, docs/records/adapt-rounds-coding-*.json)."""
    if better_by_margin(candidate, serving):
        return PUBLISH
    return RESTART if better_by_margin(serving, candidate) else TRAIN_ON


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def evenly_spaced(sequence: dict, count: int) -> list[int]:
    """`count` anchors spread over the reply (batches.valid_anchors' range), sorted."""
    first, last = max(1, sequence["prompt_len"] - 1), len(sequence["tokens"]) - 2
    if last < first:
        return []
    span = last - first + 1
    return sorted({first + (index * span) // count for index in range(min(count, span))})


class SliceSizer:
    """Each kind of slice's size (rows of taps, blocks of a step or a score), scaled after every
    slice toward the budget: shrunk at once past it, grown slowly under half of it."""

    LIMITS: ClassVar[dict[str, tuple[int, int]]] = {"taps": (8, 512), "step": (1, 16), "score": (1, 32)}

    def __init__(self, budget_s: float):
        self.budget_s = budget_s
        self.sizes = {"taps": 64, "step": 4, "score": 8}
        self.timings: deque[tuple[str, float]] = deque(maxlen=2000)  # the measure script reads it

    def size(self, kind: str) -> int:
        return self.sizes[kind]

    def observe(self, kind: str, elapsed_s: float) -> None:
        self.timings.append((kind, elapsed_s))
        if kind not in self.sizes:
            return
        low, high = self.LIMITS[kind]
        size = self.sizes[kind]
        if elapsed_s > self.budget_s:
            size = int(size * 0.8 * self.budget_s / elapsed_s)
        elif elapsed_s < self.budget_s / 2:
            size = math.ceil(size * 1.25)
        self.sizes[kind] = min(high, max(low, size))


def adaptation_for(engine: Any, recorder: ReplyRecorder | None
                   ) -> tuple[Adaptation | None, str | None]:
    """A loaded local pair's adaptation, or why there is none (it then serves as loaded)."""
    if recorder is None:
        return None, None
    if not TRAIN_WHILE_IDLE:
        return None, "training while idle is off in this process"
    if engine.pair.drafter_path is None:
        return None, "no drafter to adapt"
    try:
        return build_adaptation(engine, recorder), None
    except ImportError as exc:  # the MLX engine without torch
        return None, f"adapting the drafter needs torch (pip install 'dflash-local[torch]'): {exc}"
    except DFlashError as exc:
        log.warning("the drafter does not adapt on this load: %s", exc)
        return None, str(exc)


def build_adaptation(engine: Any, recorder: ReplyRecorder, settings: RoundSettings = RoundSettings(),
                     trainer_settings: Any = None) -> Adaptation:
    """A loaded local pair's adaptation, serving the pair's last good version at once. Torch is
    imported here (ImportError: the torch extra is missing); the trainer borrows the engine's
    torch target where it has one."""
    from dflash_local.adapt.trainer import (
        AdaptSettings,
        DrafterTrainer,
        TorchTeacher,
        replay_sequences,
        torch_device,
    )
    from dflash_local.drafter.draft_vocab import load_draft_vocab

    pair, taps = engine.pair, engine.drafter.config.target_layer_ids
    trainer_settings = trainer_settings or AdaptSettings()
    model = engine.torch_target()
    teacher = (TorchTeacher(model, taps) if model is not None
               else TorchTeacher.load(pair.target_path, taps, torch_device()))
    draft_ids = (load_draft_vocab(pair.drafter_path, engine.drafter.config.vocab_size)
                 if pair.draft_vocab_size else None)
    replay = replay_sequences(pair.drafter_path, engine.tokenizer, pair.target_path,
                              trainer_settings, settings.replay_pool)
    trainer = DrafterTrainer(pair.drafter_path, teacher.model, draft_ids, trainer_settings,
                             pull=not replay)
    versions = VersionStore(recorder.pair.key, recorder.pair.identity["target"])
    adaptation = Adaptation(engine, recorder, versions, teacher, trainer, replay, settings)
    version = versions.serving()
    if version is not None:
        try:
            adaptation.load_version(version)
        except CheckpointError as exc:  # a version the engine refuses: the shipped one serves
            log.warning("%s; the shipped drafter serves", exc)
    return adaptation


class Adaptation:
    """One loaded pair's adaptation: `has_work` and `run_slice` on the worker's thread, `status`
    on the event loop's (one lock around the store)."""

    def __init__(self, engine: Any, recorder: ReplyRecorder, versions: VersionStore, teacher: Any,
                 trainer: Any, replay: list[dict], settings: RoundSettings = RoundSettings(),
                 open_store=ReplyStore):
        self.engine, self.recorder, self.versions = engine, recorder, versions
        self.teacher, self.trainer, self.replay = teacher, trainer, replay
        self.settings = settings
        self.sizer = SliceSizer(settings.slice_budget_s)
        self.tau_recent: dict[str, float | None] = {"shipped": None, "serving": None}
        self.rounds = 0
        self.last_round: dict | None = None  # the latest round's scores and verdict (status)
        self._store = open_store()
        self._lock = threading.Lock()
        self._round: Generator[str, None, None] | None = None
        self._tapped: dict[int, dict] = {}  # reply id -> its sequence with taps
        self._replay_tapped: list[dict] = []
        self._rng = random.Random(0)
        self.taken_through = versions.taken_through()  # the replies rounds have taken in
        self._pointer_seen = versions.pointed()  # the pointer as last followed

    # --- the worker's side ---

    def has_work(self) -> bool:
        """A round runs, the version on disk is not the one serving (`adapt reset`), or enough
        new replies for a round."""
        return (self._round is not None or self.versions.pointed() != self._pointer_seen
                or self._ready())

    def _ready(self) -> bool:
        with self._lock:
            key = self.recorder.pair.key
            new = self._store.count(key, self.taken_through)
            return new >= self.settings.min_new_replies and (
                self._store.count(key) > self.settings.min_held_out)

    def run_slice(self) -> None:
        if self._round is None:
            self._round = self._run_round()
        started = time.perf_counter()
        try:
            kind = next(self._round)
        except StopIteration:
            self._round = None
            kind = "end"
        except BaseException:
            self._round = None
            raise
        self.sizer.observe(kind, time.perf_counter() - started)

    def _run_round(self) -> Generator[str, None, None]:
        yield from self._follow_pointer()
        if not self._ready():
            return
        with self._lock:  # only the newest replies are kept tapped: only they are read
            replies = list(self._store.replies(self.recorder.pair.identity, self.settings.max_tapped))
            recorded = self._store.count(self.recorder.pair.key)
        held_count = min(self.settings.held_out, max(self.settings.min_held_out, recorded // 5))
        held, train = replies[-held_count:], replies[:-held_count]
        for reply in reversed(replies):  # newest first: the held-out ones, then what trains
            if reply.id not in self._tapped:
                yield from self._tap_reply(reply)
        for sequence in self.replay[len(self._replay_tapped):][: self.settings.replay_per_round]:
            sequence = dict(sequence, taps=(yield from self._taps(sequence)))
            self._replay_tapped.append(sequence)
        pool = [self._tapped[reply.id] for reply in train if reply.id in self._tapped]
        new = sum(1 for reply in train if reply.id > self.taken_through)
        for _ in range(min(self.settings.max_steps, self.settings.steps_per_new_reply * max(1, new))):
            sequences = [self._rng.choice(pool)] if pool else []
            if self._replay_tapped and self._rng.random() < self.trainer.settings.replay_share:
                sequences.append(self._rng.choice(self._replay_tapped))
            if sequences:
                self.trainer.step(sequences, self.sizer.size("step"))
                yield "step"
        scores = yield from self._score([self._tapped[reply.id] for reply in held])
        yield from self._decide(scores, taken_through=replies[-1].id)

    def _tap_reply(self, reply: RecordedReply) -> Generator[str, None, None]:
        from dflash_local.adapt.trainer import training_sequence

        sequence = training_sequence(reply.prompt_ids, reply.reply_ids, self.trainer.settings)
        sequence["taps"] = yield from self._taps(sequence)
        self._tapped[reply.id] = sequence
        while len(self._tapped) > self.settings.max_tapped:
            del self._tapped[min(self._tapped)]

    def _taps(self, sequence: dict) -> Generator[str, None, Any]:
        chunks = self.teacher.taps(sequence["tokens"], lambda: self.sizer.size("taps"))
        while True:
            try:
                next(chunks)
            except StopIteration as done:
                return done.value
            yield "taps"

    def _score(self, held: list[dict]) -> Generator[str, None, dict[str, list[int]]]:
        """Accepted drafts per held-out block: the candidate's, the serving drafter's and (while
        an adapted version serves) the shipped one's, on the very same blocks."""
        states = {"candidate": None, "serving": self.trainer.serving}
        if self.engine.drafter_version is not None:
            states["shipped"] = self.trainer.shipped
        scores: dict[str, list[int]] = {name: [] for name in states}
        for sequence in held:
            anchors = evenly_spaced(sequence, self.settings.score_anchors)
            while anchors:
                size = self.sizer.size("score")
                chunk, anchors = anchors[:size], anchors[size:]
                for name, state in states.items():
                    scores[name] += self.trainer.accepted(state, sequence, chunk)
                yield "score"
        return scores

    def _decide(self, scores: dict[str, list[int]], taken_through: int) -> Generator[str, None, None]:
        serving_tau = tau(scores["serving"])
        self.tau_recent = {"serving": serving_tau,
                           "shipped": tau(scores.get("shipped", scores["serving"]))}
        self.rounds += 1
        self._save_progress(taken_through)
        decided = verdict(scores["candidate"], scores["serving"])
        self.last_round = {"round": self.rounds, "held_out_blocks": len(scores["serving"]),
                           "tau_serving": _rounded(serving_tau),
                           "tau_candidate": _rounded(tau(scores["candidate"])), "verdict": decided}
        if decided == PUBLISH:
            yield from self._publish(serving_tau, tau(scores["candidate"]))
        elif decided == RESTART:
            self.trainer.candidate.load_state_dict(self.trainer.serving)

    def _publish(self, tau_before: float, tau_after: float) -> Generator[str, None, None]:
        record = {"trained_on": self.trained_on(), "tau_before": round(tau_before, 4),
                  "tau_after": round(tau_after, 4), "at": now_iso(),
                  "shipped": str(self.engine.pair.drafter_path)}
        version = self.versions.publish(self.trainer.save_candidate, record)
        self._pointer_seen = version.number
        yield "publish"
        # the weights just written (rounded as the files hold them), from memory: not read back
        serving = {name: tensor.bfloat16().float() for name, tensor in self.trainer.candidate_state().items()}
        swap_drafter(self.engine, version.path, version.number,
                     {name: tensor.numpy() for name, tensor in serving.items()})
        self.trainer.serving = serving
        self.tau_recent["serving"] = round(tau_after, 4)
        log.info("adapted drafter v%d serves: tau on the recent replies %.2f -> %.2f",
                 version.number, tau_before, tau_after)
        yield "swap"

    def _follow_pointer(self) -> Generator[str, None, None]:
        """The pointer changed on disk since it was last read (`adapt reset`): serve what it
        names now (its newest good version, or the shipped drafter)."""
        pointed = self.versions.pointed()
        if pointed == self._pointer_seen:
            return
        self._pointer_seen = pointed
        version = self.versions.serving()
        if (version.number if version else None) != self.engine.drafter_version:
            self.load_version(version)
            yield "swap"

    def load_version(self, version) -> None:
        """Serve `version` (None: the shipped drafter), trainer and engine both."""
        path = version.path if version else self.engine.pair.drafter_path
        swap_drafter(self.engine, path, version.number if version else None)
        self.trainer.serve_weights_of(version.path if version else None)

    def _save_progress(self, taken_through: int) -> None:
        self.taken_through = taken_through
        self.versions.save_taken_through(taken_through)

    def _counts(self) -> tuple[int, int]:
        """(the pair's recorded replies, those no round has taken in yet)."""
        with self._lock:
            key = self.recorder.pair.key
            return self._store.count(key), self._store.count(key, self.taken_through)

    def trained_on(self) -> int:
        """Replies the rounds have taken in (trained on, the last round's held-out scored on)."""
        replies, pending = self._counts()
        return replies - pending

    # --- the event loop's side ---

    def status(self) -> dict:
        replies, pending = self._counts()
        return {"enabled": True, "recording": self.recorder.paused is None, "replies": replies,
                "pending": pending, "training": self._round is not None,
                "version": self.engine.drafter_version, "trained_on": replies - pending,
                "tau_recent": dict(self.tau_recent), "last_round": dict(self.last_round) if self.last_round else None,
                "history": self.versions.history(), "note": None}

    def close(self) -> None:
        if self._round is not None:
            self._round.close()
        with self._lock:
            self._store.close()
