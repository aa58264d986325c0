"""The values that cross layer boundaries: request parameters, stream events, capabilities."""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_local.errors import InvalidRequestError


@dataclass(frozen=True)
class Fixed:
    """Every round drafts `size` - 1 tokens (never more than the drafter's block; None: all of
    it). Fixed(1) is plain decoding, the honest baseline."""

    size: int | None = None

    def __post_init__(self):
        if self.size is not None and (not isinstance(self.size, int) or self.size < 1):
            raise InvalidRequestError(f"block_size must be an integer >= 1, got {self.size!r}")

    def __str__(self) -> str:
        return "full" if self.size is None else str(self.size)

    @property
    def request_value(self) -> int | None:
        """As a request or a record writes it (None: the drafter's whole block)."""
        return self.size


@dataclass(frozen=True)
class Auto:
    """Each round's width chosen from this machine's measured round costs (planning/auto.py)."""

    def __str__(self) -> str:
        return "auto"

    @property
    def request_value(self) -> str:
        return "auto"


BlockSize = Fixed | Auto
AUTO = Auto()
WHOLE_BLOCK = Fixed()  # the drafter's own block, every round


def parse_block_size(value: int | str | None) -> BlockSize:
    """A request's or a command line's block size: an integer >= 1, "auto", or None (the
    drafter's whole block)."""
    if value is None:
        return WHOLE_BLOCK
    if value == "auto":
        return AUTO
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"block_size must be an integer or 'auto', got {value!r}")
    return Fixed(value)


def widest_block(params: GenerationParams, drafter_block: int | None) -> int:
    """The widest round the loop may run: 1 (plain) without a drafter or speculation; the
    drafter's block under auto; a fixed size never past the block the drafter was trained on."""
    if not params.speculative or not drafter_block or drafter_block < 2:
        return 1
    size = params.block_size.size if isinstance(params.block_size, Fixed) else None
    return drafter_block if size is None else min(size, drafter_block)


MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs
# below this a temperature is greedy (vLLM's rule): logits divided by 1e-320 overflow to NaN
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of one committed token: log_softmax of its raw logits (before
    temperature, top-k and top-p), and its most probable tokens, best first (logprobs.py)."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "lark")


@dataclass(frozen=True)
class OutputConstraint:
    """What a reply's text must follow (dflash_local/constraints/ compiles it for a tokenizer).
    `kind`: one of CONSTRAINT_KINDS; `source`: the JSON Schema as JSON text ("{}" for
    json_object), the regex, or the Lark grammar."""

    kind: str
    source: str

    def __post_init__(self):
        if self.kind not in CONSTRAINT_KINDS:
            raise InvalidRequestError(
                f"a constraint's kind must be one of {', '.join(CONSTRAINT_KINDS)}, got {self.kind!r}")


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None
    speculative: bool = True
    block_size: BlockSize = WHOLE_BLOCK  # parse_block_size makes one from a request's value
    stop_token_ids: tuple[int, ...] = ()
    prompt_lookup: bool = True  # with block_size auto: rounds may verify lookup.py drafts
    tree: bool = True  # drafter rounds verify a tree of drafts (draft_tree.py) where the engine can
    draft_window: int | None = None  # the drafter keeps this many context rows (None: the engine's)
    logprobs: int | None = None  # report each token's logprob and this many top alternatives (0-20)
    constraint: OutputConstraint | None = None  # the reply follows this schema, regex or grammar

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if self.temperature < GREEDY_BELOW_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)  # frozen: set once, as it is parsed
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0, got {self.top_k!r}")
        check_draft_window(self.draft_window)
        top = self.logprobs
        if top is not None and (isinstance(top, bool) or not isinstance(top, int)
                                or not 0 <= top <= MAX_TOP_LOGPROBS):
            raise InvalidRequestError(f"logprobs (top alternatives) must be an integer in "
                                      f"[0, {MAX_TOP_LOGPROBS}], got {top!r}")
        if not isinstance(self.block_size, Fixed | Auto):
            raise InvalidRequestError(
                f"block_size must be Fixed(n) or Auto() (parse_block_size), got {self.block_size!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class StepEvent:
    """What one round committed. The first event of a generation is the prefill's token."""

    token_ids: tuple[int, ...]
    text: str = ""
    drafted: int = 0  # tokens proposed this round (a tree's nodes, a lookup chain grafted on included)
    draft_depth: int = 0  # the longest draft path (= drafted for a chain): the most it could keep
    accepted: int = 0  # of those, how many the target kept (the bonus token is not counted)
    round_index: int = 0  # 0 = prefill token, then 1, 2, ...
    elapsed_s: float = 0.0  # since the start of decoding (after prefill)
    prefill_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt's tokens, those a kept prefix gave (not computed)
    cached_tier: str | None = None  # the prefix cache's tier that gave them: "ram" or "disk"
    width: int = 1  # this round's width: the anchor and the drafted tokens (1 = plain step)
    accepted_chars: int = 0  # how much of `text` (from its start) the accepted drafts made
    lookup_accepted: int = 0  # of `accepted`, the last ones a prompt-lookup draft brought, not the drafter
    lookup_accepted_chars: int = 0  # of `accepted_chars`, the last ones those lookup tokens made
    mode: str = "speculative"  # "plain" | "speculative" | "plain-fallback" | "probe" | "lookup" (planning/)
    finish_reason: str | None = None  # "stop" | "length" on the last event
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token_ids entry when params.logprobs asks
    constraint_s: float = 0.0  # the output constraint's seconds so far (masks, matcher steps)


def decode_rate(completion_tokens: int, decode_s: float) -> float:
    """Decode tokens/s: the tokens after the prefill's own token, over the decode time."""
    produced = completion_tokens - 1
    return produced / decode_s if decode_s > 0 and produced > 0 else 0.0


def prefill_rate(prompt_tokens: int, prefill_s: float) -> float:
    """Prefill tokens/s: the prompt's tokens over the time to the first generated token."""
    return prompt_tokens / prefill_s if prefill_s > 0 else 0.0


@dataclass
class GenerationStats:
    """Running totals over a generation's events; τ counts rounds after prefill."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, those a kept prefix gave (prefix_cache.py)
    cached_tier: str | None = None  # which tier of the prefix cache gave them: "ram" or "disk"
    completion_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    draft_depth: int = 0  # drafts a kept path could have reached (a tree's siblings not counted)
    accepted: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    accepted_per_round: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    drafter_version: int | None = None  # the adapted drafter's version that drafted (None: as loaded)

    def add(self, event: StepEvent) -> None:
        self.completion_tokens += len(event.token_ids)
        if event.round_index == 0:
            self.prompt_tokens = event.prompt_tokens
            self.cached_tokens = event.cached_tokens
            self.cached_tier = event.cached_tier
            self.prefill_s = event.prefill_s
        else:
            self.rounds += 1
            self.drafted += event.drafted
            self.draft_depth += event.draft_depth
            self.accepted += event.accepted
            self.accepted_per_round.append(len(event.token_ids))
        self.decode_s = event.elapsed_s
        if event.finish_reason:
            self.finish_reason = event.finish_reason

    @property
    def prefill_tokens(self) -> int:
        """The prompt's tokens the prefill computed (the rest came from a kept prefix)."""
        return self.prompt_tokens - self.cached_tokens

    @property
    def tau(self) -> float:
        return sum(self.accepted_per_round) / self.rounds if self.rounds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return decode_rate(self.completion_tokens, self.decode_s)

    @property
    def prefill_tokens_per_s(self) -> float:
        return prefill_rate(self.prefill_tokens, self.prefill_s)


@dataclass(frozen=True)
class EngineCapabilities:
    speculative_toggle: bool  # can switch speculation per request
    sampling: bool
    max_context: int
    hybrid_targets: bool = False
    block_size_per_request: bool = True
    tokenizes: bool = True  # False: a served engine (URL, vLLM, SGLang): messages in, no ids
    tree_verify: bool = False  # a round may verify a draft tree, not only a chain (draft_tree.py)
    logprobs: bool = False  # StepEvents carry each token's logprobs when params ask (logprobs.py)


def check_draft_window(window: int | None, context: int | None = None) -> None:
    """The draft sliding window: the drafter keeps only the last `window` context rows (draft
    cost and memory stay flat on long contexts). None = unbounded. A window past the target's
    context would bound nothing: refused, as is one below 1."""
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise InvalidRequestError(f"draft_window must be an integer >= 1, got {window!r}")
    if context is not None and window > context:
        raise InvalidRequestError(f"draft_window {window} > the target's context of {context} "
                                  f"tokens: a window must fit in the context")

