"""The Engine interface every backend implements, and the pair an engine has loaded.

A local engine (MLX, Transformers: engines/local.py) runs our speculative loop in this process;
a served engine (vLLM, SGLang, any OpenAI server: engines/openai_engine.py) streams from a
server. Both yield the same StepEvents and declare what they can do in `capabilities`
(events.EngineCapabilities), so the service, the TUI and the benchmark never care which.

Boundary: the contract only; no framework, no loading, no templating (engines/chat_prompt.py).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_local.errors import InvalidRequestError
from dflash_local.events import (
    BlockSize,
    EngineCapabilities,
    GenerationParams,
    StepEvent,
    TokenLogprob,
)

if TYPE_CHECKING:
    from dflash_local.method.planning.costs import BatchCosts
    from dflash_local.method.shared_rounds import RoundSharing


@dataclass(frozen=True)
class PairInfo:
    engine: str
    target: str  # the name the user gave (repo id or path)
    drafter: str | None
    target_path: Path | None = None  # resolved local directory
    drafter_path: Path | None = None
    dtype: str = "float32"
    drafter_block: int = 1  # the drafter's block: the width it was trained on (1 = no drafter)
    draft_vocab_size: int | None = None  # drafting scores this many ids (None: the whole vocabulary)

    @classmethod
    def local(cls, engine: str, target_path, drafter_path, target_name: str | None,
              drafter_name: str | None, dtype: str, drafter_block: int,
              draft_vocab_size: int | None = None) -> PairInfo:
        """A pair loaded from local directories; names default to the paths."""
        return cls(engine=engine, target=target_name or str(target_path),
                   drafter=(drafter_name or str(drafter_path)) if drafter_path else None,
                   target_path=Path(target_path), drafter_path=Path(drafter_path) if drafter_path else None,
                   dtype=dtype, drafter_block=drafter_block, draft_vocab_size=draft_vocab_size)


class Engine(abc.ABC):
    name: str
    capabilities: EngineCapabilities
    pair: PairInfo
    last_stats = None  # a served engine: its server's totals for the last generation
    sharing: RoundSharing | None = None  # the worker's lanes, where generations share (share_rounds)
    drafter_version: int | None = None  # an adapted drafter's version (adapt/), None: as loaded
    # ids below this have both an embedding row and a text (a local engine's tokenizer and
    # target); None: unknown here (a served engine's vocabulary is its server's)
    token_id_limit: int | None = None

    def torch_target(self):
        """The target as a torch module where the engine runs one (adaptation's trainer borrows
        it); None: it has none."""

    @abc.abstractmethod
    def encode_chat(self, messages: list[dict], thinking: bool | None = None,
                    tools: list[dict] | None = None,
                    assistant_prefix: str | tuple[str, ...] = "") -> list[int]:
        """Apply the target's chat template (thinking on/off where it has the switch; `tools`
        rendered by it), ending with `assistant_prefix` as the reply's start: template text, or
        pieces alternating template text and client text (chat_prompt.AssistantPrefix)."""

    def check_request_size(self, messages: list[dict], tools: list[dict] | None = None) -> None:
        """Refuse, before the request waits for the worker, one that surely cannot fit the
        context, without templating it (a local engine counts with its tokenizer). A served
        engine's server judges its own requests."""

    @abc.abstractmethod
    def encode_raw(self, text: str) -> list[int]:
        """Tokenize text as it is, no template."""

    @abc.abstractmethod
    def stream(self, prompt_ids: list[int], params: GenerationParams) -> Iterator[StepEvent]:
        """Generate; each event carries its text delta. Closing the iterator cancels."""

    def score_prompt(self, prompt_ids: list[int], top: int,
                     params: GenerationParams) -> tuple[TokenLogprob, ...]:
        """The target's log-probability of each prompt token after the first, from the row
        before it, with its `top` alternatives (engines/prompt_scores.py); `params`: the
        generation that follows. Only an engine that declares `capabilities.logprobs`."""
        raise InvalidRequestError(f"the {self.name} engine does not score prompts: a served "
                                  f"engine relays text, not log-probabilities")

    def stream_chat(self, messages: list[dict], params: GenerationParams,
                    thinking: bool | None = None) -> Iterator[StepEvent]:
        """Template + generate in one call. A served engine overrides this (it cannot tokenize)."""
        return self.stream(self.encode_chat(messages, thinking), params)

    def share_rounds(self, sharing: RoundSharing | None) -> None:
        """Hand every generation's verify to `sharing` (the worker's lanes, service/lanes.py:
        batched with the others') and let it switch between the chunks of a prompt's prefill;
        None: each generation runs alone. A served engine's server batches its own requests
        (it never reads `sharing`)."""
        self.sharing = sharing

    def prepare(self, block_size: BlockSize, on_wait: Callable[[str], None] | None = None,
                recalibrate: bool = False) -> None:
        """The work at load that generations at this default block size need (a local engine's
        calibration under auto); `on_wait(what)` before a wait worth telling the user about.
        `recalibrate`: measure again what is cached. A served engine has nothing to prepare."""

    def batch_costs(self) -> BatchCosts | None:
        """What a round costs as a lane's part of a batch (the calibration's fit): how the
        worker's lanes split a batch's time among its generations; None: by rows."""
        return None

    def calibration_status(self) -> dict | None:
        """The calibration auto plans with, for /dflash/status and the CLI (when measured, whether
        its timings are reliable and why not); None: none (a served engine, a fixed width)."""
        return None

    def generation_bytes(self) -> int | None:
        """Memory one generation's caches reach at the full context (the worker's batch is
        bounded by it); None: a served engine's server holds them."""
        return None

    def close(self) -> None:
        """Free what the engine holds (models, child processes)."""

    def preload_prefix_cache(self) -> int:
        """Read the latest entries of a prefix cache that outlives the process into RAM (a
        local engine's disk tier: engines/local.py), so the first request after a restart, an
        agent's fixed system prompt and tools above all, starts warm; returns how many came.
        The service calls it at load. A served engine keeps no cache of ours."""
        return 0

    def warm_next_turn(self, messages: list[dict], reply: str, prompt_ids: list[int],
                       params: GenerationParams, thinking: bool | None,
                       should_stop: Callable[[], bool]) -> bool:
        """Ready the cache for the request that continues this conversation (a local engine's
        prefix cache: engines/turn_warmup.py); True when an entry was stored. A served engine
        keeps no cache of ours."""
        return False
