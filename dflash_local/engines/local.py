"""LocalEngine: what the MLX and Transformers engines share. One construction path, whose
framework steps are the hooks each engine implements, and the generation: our speculative loop
over the engine's TargetRunner and Drafter, the prefix cache and the round costs.

Loading a pair, in order: the target's config (read once), the dtype, the context (the target
refused from its config before any weight loads), the memory fit (pairs/load_fit.py), the draft window, the drafter's config and
its draft vocabulary (the pair refused from the configs), precision notes, the target's
weights, the accelerations, the drafter, the prefix cache, the thread count.
Boundary: no framework is imported here (engines/mlx_engine.py, engines/torch_engine.py do).
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import replace
from pathlib import Path
from typing import Any

from dflash_local import paths
from dflash_local.constraints.compile import ConstraintCompiler
from dflash_local.drafter.config import (
    DrafterConfig,
    load_checked_drafter_config,
    load_target_info,
    read_target_config,
)
from dflash_local.drafter.draft_vocab import load_draft_vocab
from dflash_local.engines import chat_prompt, prompt_scores
from dflash_local.engines.detokenize import StreamDetokenizer
from dflash_local.engines.interface import Engine, PairInfo
from dflash_local.engines.turn_warmup import OpenGenerations, warm
from dflash_local.errors import CheckpointError
from dflash_local.events import (
    Auto,
    BlockSize,
    EngineCapabilities,
    GenerationParams,
    StepEvent,
    TokenLogprob,
    check_draft_window,
    widest_block,
)
from dflash_local.method import calibration, prefix_disk, speculative
from dflash_local.method.interfaces import Drafter, TargetRunner
from dflash_local.method.planning.costs import BatchCosts
from dflash_local.method.planning.observed import RoundTimes
from dflash_local.method.prefix_cache import (
    Hit,
    PrefixStates,
    Resume,
    budget_bytes,
    machine_memory_bytes,
    make_prefix_cache,
)
from dflash_local.method.prefix_disk_format import LeafCodec
from dflash_local.method.round_trace import RoundTrace
from dflash_local.method.shared_rounds import shared_loop
from dflash_local.pairs.load_fit import check_load_fits, model_name
from dflash_local.pairs.precision import resolve_dtype

log = logging.getLogger(__name__)
PREFIX_CACHE_DIR = "prefix-cache"  # under the data dir: the prefix cache's disk tier
# at load, the disk tier's latest entries are read into RAM: an agent's fixed prefix or the
# conversations of the last session, not the whole tier (a read costs load time)
PRELOAD_ENTRIES = 4
PRELOAD_SHARE = 2  # at most this fraction (1/2) of the RAM tier's budget


def prefix_cache_root() -> Path:
    """Where every pair's disk tier lives (not created here: one that cannot be leaves the
    engine RAM-only, with a warning)."""
    return paths.data_dir_path() / PREFIX_CACHE_DIR


def _checked_prefix_budgets(enabled: bool, ram_mb: int | None, disk_mb: int | None) -> int:
    """The prefix cache's budgets refused before any weight loads (a RAM budget given: checked
    against the machine; its default needs the loaded pair); returns the disk tier's in bytes
    (0: off)."""
    if not enabled:
        return 0
    if ram_mb is not None:
        budget_bytes(ram_mb, machine_memory_bytes())
    return prefix_disk.disk_budget_bytes(disk_mb, prefix_cache_root())


class LocalEngine(Engine):
    """Loads a pair from local directories and runs our loop on it; a subclass implements the
    hooks below for its framework."""

    dtypes: dict[str, Any]  # the framework's dtype of each name the engine runs in

    def __init__(self, target_path: Path, drafter_path: Path | None, *,
                 target_name: str | None = None, drafter_name: str | None = None,
                 dtype: str = "float32", draft_window: int | None = None, draft_vocab: bool = True,
                 prefix_cache: bool = True, prefix_cache_mb: int | None = None,
                 prefix_cache_disk_mb: int | None = None):
        """`dtype`: auto or one of `dtypes`; `draft_window`: the drafter's context rows (None:
        unbounded); `draft_vocab=False`: the drafter scores the whole vocabulary
        (scripts/experiments/draft_vocab_ab.py compares); `prefix_cache` / `prefix_cache_mb`: recent
        conversations' states (method/prefix_cache.py); `prefix_cache_disk_mb`: their disk tier
        under the data dir (method/prefix_disk.py; None: its default, 0: off)."""
        raw_config = read_target_config(target_path)  # once: every check below reads it
        dtype = self._checked_dtype(dtype, raw_config)
        max_context = self.target_context(target_path, raw_config)  # a target it cannot run: refused
        # before any weight is allocated: a pair that cannot fit would take the machine down
        check_load_fits(self.name, model_name(target_name or str(target_path), target_path),
                        target_path, drafter_path, dtype, self.on_accelerator())
        check_draft_window(draft_window, max_context)  # before any weight loads
        disk_budget = _checked_prefix_budgets(prefix_cache, prefix_cache_mb, prefix_cache_disk_mb)
        self.target_info = target_info = load_target_info(target_path, raw_config)  # swaps check against it
        drafter_config = (load_checked_drafter_config(drafter_path, target_path, target_info)
                          if drafter_path else None)
        draft_ids = (load_draft_vocab(drafter_path, drafter_config.vocab_size)
                     if drafter_config is not None and draft_vocab else None)
        self.warn_precision(dtype, raw_config)
        self.tokenizer = self.load_target(target_path, dtype)
        self.token_id_limit = min(len(self.tokenizer), target_info.embedding_rows)
        self.accelerations = self.install_accelerations(drafter_config)
        self.drafter = None
        if drafter_config is not None:
            self.drafter = self.load_bound_drafter(drafter_path, drafter_config, dtype,
                                                   draft_ids)
        self.draft_window = draft_window
        self.pair = PairInfo.local(self.name, target_path, drafter_path, target_name, drafter_name,
                                   dtype, drafter_config.block_size if drafter_config else 1,
                                   draft_vocab_size=len(draft_ids) if draft_ids else None)
        self.capabilities = EngineCapabilities(
            speculative_toggle=True, sampling=True, max_context=max_context,
            hybrid_targets=True, logprobs=True, tree_verify=self.exact_tree_verify())
        taps = len(drafter_config.target_layer_ids) if drafter_config else 0
        self.row_bytes = self.kept_row_bytes(raw_config, dtype, taps)  # target KV + taps
        self.prefix_cache = make_prefix_cache(prefix_cache, prefix_cache_mb, self.row_bytes)
        self.prefix_states = self.make_prefix_states()
        self.prefix_disk = (self._make_prefix_disk(disk_budget)
                            if self.prefix_cache is not None else None)
        self._ready_to_generate()
        self.choose_threads()

    def _checked_dtype(self, dtype: str, raw_config: dict) -> str:
        """`dtype`, auto resolved for this device and checkpoint (pairs/precision.py)."""
        dtype = resolve_dtype(dtype, accelerator=self.on_accelerator(), target_config=raw_config)
        if dtype not in self.dtypes:
            raise CheckpointError(f"dtype {dtype!r} is not one of auto, {', '.join(self.dtypes)}")
        return dtype

    def _make_prefix_disk(self, budget: int) -> prefix_disk.DiskTier | None:
        """The disk tier of this pair's states: keyed by both models' files, the dtype, the
        engine and where its arrays are restored, so no other pair is served its entries."""
        root = prefix_cache_root()
        codec = self.make_prefix_codec()
        identity = {"engine": self.name, "dtype": self.pair.dtype, "codec": codec.identity,
                    "target": prefix_disk.files_signature(self.pair.target_path),
                    "drafter": prefix_disk.files_signature(self.pair.drafter_path),
                    "draft_vocab": self.pair.draft_vocab_size}
        return prefix_disk.make_disk_tier(root, identity, budget, codec)

    def _ready_to_generate(self) -> None:
        self.eos_token_ids = chat_prompt.end_of_turn_ids(
            self.tokenizer, chat_prompt.generation_config_eos(self.pair.target_path))
        self.constraints = ConstraintCompiler(self.tokenizer)  # each schema compiled once
        self.markup_floors = chat_prompt.message_markup_floors(self.tokenizer)  # no request's cost
        # this machine's round costs for the pair (`calibrate`); None: auto plans uncalibrated
        self.calibration: calibration.Calibration | None = None
        self.round_times = RoundTimes()  # its generations' timed rounds (planning/observed.py)
        self.prefix_cache_note: str | None = None  # why this engine's states are not kept
        self._generations = OpenGenerations()  # a warm-up runs while none is open (turn_warmup.py)
        self.round_trace: RoundTrace | None = None  # opt-in: every round's costs (round_trace.py)

    # --- the construction's framework steps, in the order they run ---

    @abc.abstractmethod
    def on_accelerator(self) -> bool:
        """Whether the engine runs on a GPU (auto dtype: the checkpoint's own there)."""

    @abc.abstractmethod
    def target_context(self, target_path: Path, raw_config: dict) -> int:
        """The context the engine declares, every request checked against it; a target this
        engine cannot run is refused here, from its config alone."""

    def warn_precision(self, dtype: str, raw_config: dict) -> None:
        """Log what this precision costs here, before the weights load."""

    @abc.abstractmethod
    def load_target(self, target_path: Path, dtype: str):
        """Load the target's weights in `dtype` (kept by the engine); returns its tokenizer."""

    @abc.abstractmethod
    def install_accelerations(self, drafter_config: DrafterConfig | None) -> list:
        """Install this machine's kernels on the loaded target; what `close` uninstalls."""

    @abc.abstractmethod
    def load_bound_drafter(self, drafter_path: Path, drafter_config: DrafterConfig, dtype: str,
                     draft_ids: list[int] | None, weights: dict | None = None):
        """The drafter (`weights`: its numpy arrays, in place of its files'), bound to the
        target's embeddings and head, drafting only `draft_ids` where given; taps readied."""

    @abc.abstractmethod
    def exact_tree_verify(self) -> bool:
        """Whether a tree verify is exact on the loaded target."""

    @abc.abstractmethod
    def kept_row_bytes(self, raw_config: dict, dtype: str, taps: int) -> int:
        """Bytes one kept row of a conversation costs (the prefix cache's budget counts them)."""

    @abc.abstractmethod
    def make_prefix_states(self) -> PrefixStates:
        """How this engine keeps and restores a generation's state (method/prefix_cache.py)."""

    @abc.abstractmethod
    def make_prefix_codec(self) -> LeafCodec:
        """How the disk tier writes and reads those states (method/prefix_disk_format.py)."""

    def choose_threads(self) -> None:
        """Pick the thread count the loaded pair runs fastest with here, where the engine can."""

    def close(self) -> None:
        """Stop the disk tier's writer, its queued entries written first (a subclass frees its
        framework's part, then calls this)."""
        if self.prefix_disk is not None:
            self.prefix_disk.close()

    # --- per generation ---

    @abc.abstractmethod
    def make_runner(self, collect_taps: bool) -> TargetRunner:
        """A fresh per-generation target runner (own cache)."""

    @abc.abstractmethod
    def make_drafter(self, window: int | None = None) -> Drafter | None:
        """A fresh per-generation drafter (own context cache, bounded to the last `window` rows;
        None: the engine's draft window), or None without a drafter."""

    def compute_threads(self) -> int | None:
        """CPU threads the engine's matmuls use, where it knows: round costs depend on it."""
        return None

    def generation_bytes(self) -> int:
        return self.row_bytes * self.capabilities.max_context

    def prepare(self, block_size: BlockSize, on_wait: Callable[[str], None] | None = None,
                recalibrate: bool = False) -> None:
        if isinstance(block_size, Auto) and self.pair.drafter is not None:
            self.calibrate(force=recalibrate,
                           on_measure=on_wait and (lambda: on_wait(calibration.CALIBRATING)))

    def preload_prefix_cache(self) -> int:
        """The disk tier's most recently used entries of this pair, at most PRELOAD_ENTRIES
        within 1/PRELOAD_SHARE of the RAM budget, read into RAM."""
        disk, cache = self.prefix_disk, self.prefix_cache
        if disk is None or cache is None:
            return 0
        chosen = disk.recent(PRELOAD_ENTRIES, cache.budget // PRELOAD_SHARE)
        loaded = 0
        for name in reversed(chosen):  # the latest stored last: the RAM tier's most recent
            entry = disk.load(name)
            if entry is not None and cache.store(entry.token_ids.tolist(), entry.kept):
                loaded += 1
        return loaded

    def calibrate(self, force: bool = False,
                  on_measure: Callable[[], None] | None = None) -> calibration.Calibration:
        """This machine's round costs for the pair, which the auto planner prices rounds with:
        measured once (~20-30 s for the embedded pair on two cores), then read from its cache
        file, unless `force`. Kept in `self.calibration`."""
        key = calibration.calibration_key(self.pair, self.compute_threads())
        trace, self.round_trace = self.round_trace, None  # its own generations are not traced
        try:
            self.calibration = calibration.load_or_measure(self, key, force, on_measure)
        finally:
            self.round_trace = trace
        self.round_times = RoundTimes()  # rounds timed against this calibration, from now on
        return self.calibration

    def encode_chat(self, messages: list[dict], thinking: bool | None = None,
                    tools: list[dict] | None = None, assistant_prefix: str | tuple[str, ...] = "") -> list[int]:
        return chat_prompt.request_prompt_ids(self.tokenizer, messages, self.capabilities.max_context,
                                              thinking, tools, assistant_prefix, self.markup_floors)

    def check_request_size(self, messages: list[dict], tools: list[dict] | None = None) -> None:
        chat_prompt.check_prompt_length(self.tokenizer, messages, self.capabilities.max_context,
                                        self.markup_floors, tools)

    def encode_raw(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    def decode(self, token_ids) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def stream(self, prompt_ids: list[int], params: GenerationParams) -> Iterator[StepEvent]:
        with self._generations:  # no warm-up's chunk beside it (a caller of its own, as the bench)
            yield from self._stream(prompt_ids, params)

    def _stream(self, prompt_ids: list[int], params: GenerationParams) -> Iterator[StepEvent]:
        if not params.stop_token_ids:
            params = replace(params, stop_token_ids=tuple(self.eos_token_ids))
        check_draft_window(params.draft_window, self.capabilities.max_context)
        # plain decoding (block 1) runs without a drafter and collects no taps
        drafter = (self.make_drafter(params.draft_window)
                   if widest_block(params, self.pair.drafter_block) > 1 else None)
        grammar = (self.constraints.grammar(params.constraint)
                   if params.constraint is not None else None)
        runner = self.make_runner(collect_taps=drafter is not None)
        measured, sharing = self.calibration, self.sharing
        planner = speculative.default_planner(
            runner, drafter, prompt_ids, params, measured.costs if measured else None,
            measured.prior if measured else (), self.round_times, sharing and sharing.in_flight)
        resume = self._resume(prompt_ids, runner, drafter)
        detokenizer = StreamDetokenizer(self.tokenizer)
        if self.round_trace is not None:
            self.round_trace.generation(prompt_tokens=len(prompt_ids), max_tokens=params.max_tokens,
                                        cached_tokens=resume.cached_rows if resume else 0)
        # the worker's lanes (service/lanes.py) batch its proposals and verifies with the others'
        shared_runner, shared_drafter, timer = shared_loop(runner, drafter, self.sharing)
        # closing: a client that stops reading ends the loop now, and its state is kept now
        with closing(speculative.generate(shared_runner, shared_drafter, prompt_ids, params, planner,
                                          resume, self.round_trace, grammar, timer)) as events:
            for event in events:
                # how much of the text the drafter's accepted tokens made, then a lookup
                # draft's: a client colours exactly what each wrote
                text, (drafter_chars, accepted_chars) = detokenizer.add_split(
                    event.token_ids, (event.accepted - event.lookup_accepted, event.accepted))
                yield replace(event, text=text, accepted_chars=accepted_chars,
                              lookup_accepted_chars=accepted_chars - drafter_chars,
                              constraint_s=grammar.busy_s if grammar is not None else 0.0)

    def score_prompt(self, prompt_ids: list[int], top: int,
                     params: GenerationParams) -> tuple[TokenLogprob, ...]:
        with self._generations:  # as a generation, never beside a warm-up's chunk
            return prompt_scores.score_prompt(self, prompt_ids, top, params)

    def _lookup(self, prompt_ids: list[int], needs_taps: bool) -> Hit | None:
        """The RAM tier's hit, or the disk tier's where it gives more rows (loaded, then kept
        in RAM too)."""
        hit = self.prefix_cache.lookup(prompt_ids, needs_taps)
        disk = self.prefix_disk
        if disk is None or (hit is not None and hit.rows >= len(prompt_ids) - 1):
            return hit
        found = disk.lookup(prompt_ids, needs_taps)
        if found is None or (hit is not None and found[1] <= hit.rows):
            return hit
        entry = disk.load(found[0])
        if entry is None:
            return hit
        self.prefix_cache.store(entry.token_ids.tolist(), entry.kept)
        return Hit(entry, found[1], tier="disk")

    def batch_costs(self) -> BatchCosts | None:
        return self.calibration.costs.batch if self.calibration else None

    def calibration_status(self) -> dict | None:
        return self.calibration.status() if self.calibration else None

    def prefix_cache_status(self) -> dict | None:
        """The prefix cache's tiers for /dflash/status (None: the cache is off)."""
        if self.prefix_cache is None:
            return None
        return {"ram": {"budget_bytes": self.prefix_cache.budget, "bytes": self.prefix_cache.nbytes,
                        "entries": len(self.prefix_cache)},
                "disk": self.prefix_disk.status() if self.prefix_disk is not None else None}

    def warm_next_turn(self, messages: list[dict], reply: str, prompt_ids: list[int],
                       params: GenerationParams, thinking: bool | None,
                       should_stop: Callable[[], bool]) -> bool:
        ids = chat_prompt.next_turn_ids(self.tokenizer, messages, reply, prompt_ids, thinking)
        return ids is not None and warm(
            self, ids, params, lambda: self._generations.count > 0 or should_stop(),
            self._generations.guard)

    def _resume(self, prompt_ids: list[int], runner: TargetRunner,
                drafter: Drafter | None) -> Resume | None:
        """The longest kept prefix of the prompt, restored into this generation's runner and
        drafter, and where the generation's own state goes when it ends."""
        cache, states = self.prefix_cache, self.prefix_states
        if cache is None or states is None or not states.accepts(drafter):
            return None
        hit = self._lookup(prompt_ids, needs_taps=drafter is not None)
        resume = Resume(keep_prompt=states.keeps_prompt(runner))
        if hit is not None:
            resume.unseen_taps = states.restore(hit.entry.kept, hit.rows, runner, drafter)
            resume.cached_rows = hit.rows
            resume.cached_tier = hit.tier

        def keep(row_ids: list[int], unseen_taps) -> None:
            kept = states.snapshot(runner, drafter, unseen_taps)
            if isinstance(kept, str):
                if self.prefix_cache_note is None:
                    log.warning("prefix cache: %s", kept)
                self.prefix_cache_note = kept
                return
            cache.store(row_ids, kept)
            if self.prefix_disk is not None:
                self.prefix_disk.submit(row_ids, kept)

        resume.keep = keep
        return resume
