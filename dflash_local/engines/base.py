"""The Engine interface every backend implements, and the shared base of the local engines.

A local engine (MLX, Transformers) runs our speculative loop over a framework-specific
TargetRunner and Drafter; a remote engine (vLLM, SGLang, any OpenAI server) streams from a server.
Both yield the same StepEvents, so the service, the TUI and the benchmark never care which.
"""

from __future__ import annotations

import abc
import json
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass, replace
from pathlib import Path

from dflash_local.engines.client_text import client_strings, encode_marked, mark_special_texts
from dflash_local.engines.detokenize import StreamDetokenizer
from dflash_local.engines.turn_warmup import warm
from dflash_local.errors import InvalidRequestError, PromptTooLongError
from dflash_local.events import (
    Auto,
    BlockSize,
    EngineCapabilities,
    GenerationParams,
    StepEvent,
    check_draft_window,
    widest_block,
)
from dflash_local.method import calibration, speculative
from dflash_local.method.interfaces import Drafter, TargetRunner
from dflash_local.method.prefix_cache import PrefixCache, PrefixStates, Resume
from dflash_local.method.round_trace import RoundTrace

log = logging.getLogger(__name__)


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

    @abc.abstractmethod
    def encode_chat(self, messages: list[dict], thinking: bool | None = None,
                    tools: list[dict] | None = None, assistant_prefix: str = "") -> list[int]:
        """Apply the target's chat template (thinking on/off where it has the switch; `tools`
        rendered by it), ending with `assistant_prefix` as the reply's start."""

    @abc.abstractmethod
    def encode_raw(self, text: str) -> list[int]:
        """Tokenize text as it is, no template."""

    @abc.abstractmethod
    def stream(self, prompt_ids: list[int], params: GenerationParams) -> Iterator[StepEvent]:
        """Generate; each event carries its text delta. Closing the iterator cancels."""

    def stream_chat(self, messages: list[dict], params: GenerationParams,
                    thinking: bool | None = None) -> Iterator[StepEvent]:
        """Template + generate in one call. A served engine overrides this (it cannot tokenize)."""
        return self.stream(self.encode_chat(messages, thinking), params)

    def prepare(self, block_size: BlockSize, on_wait: Callable[[str], None] | None = None,
                recalibrate: bool = False) -> None:
        """The work at load that generations at this default block size need (a local engine's
        calibration under auto); `on_wait(what)` before a wait worth telling the user about.
        `recalibrate`: measure again what is cached. A served engine has nothing to prepare."""

    def close(self) -> None:
        """Free what the engine holds (models, child processes)."""

    def warm_next_turn(self, messages: list[dict], reply: str, prompt_ids: list[int],
                       params: GenerationParams, thinking: bool | None,
                       should_stop: Callable[[], bool]) -> bool:
        """Ready the cache for the request that continues this conversation (a local engine's
        prefix cache: engines/turn_warmup.py); True when an entry was stored. A served engine
        keeps no cache of ours."""
        return False


class LocalEngine(Engine):
    """Shared by MLX and Transformers: tokenizer handling and the loop; subclasses build runners."""

    def __init__(self, tokenizer, pair: PairInfo, capabilities: EngineCapabilities,
                 prefix_cache: PrefixCache | None = None, prefix_states: PrefixStates | None = None):
        self.tokenizer = tokenizer
        self.pair = pair
        self.capabilities = capabilities
        self.eos_token_ids = end_of_turn_ids(tokenizer, generation_config_eos(pair.target_path))
        # this machine's round costs for the pair (`calibrate`); None: auto plans uncalibrated
        self.calibration: calibration.Calibration | None = None
        # recent conversations' states (prefix_cache.py); None: every prompt computed whole
        self.prefix_cache = prefix_cache
        self.prefix_states = prefix_states
        self.prefix_cache_note: str | None = None  # why this engine's states are not kept
        self._warm_guard = threading.Lock()  # held by a warm-up's chunk (turn_warmup.py)
        self._open_streams = 0
        self.round_trace: RoundTrace | None = None  # opt-in: every round's costs (round_trace.py)

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

    def prepare(self, block_size: BlockSize, on_wait: Callable[[str], None] | None = None,
                recalibrate: bool = False) -> None:
        if isinstance(block_size, Auto) and self.pair.drafter is not None:
            self.calibrate(force=recalibrate,
                           on_measure=on_wait and (lambda: on_wait(calibration.CALIBRATING)))

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
        return self.calibration

    def encode_chat(self, messages: list[dict], thinking: bool | None = None,
                    tools: list[dict] | None = None, assistant_prefix: str = "") -> list[int]:
        check_texts(messages, tools)  # once, before any tokenizer sees them
        check_prompt_length(self.tokenizer, messages, self.capabilities.max_context)
        return _prompt_ids_of_checked(self.tokenizer, messages, thinking, tools, assistant_prefix)

    def encode_raw(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    def decode(self, token_ids) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def stream(self, prompt_ids: list[int], params: GenerationParams) -> Iterator[StepEvent]:
        # a warm-up's chunk in flight ends first, and none starts while a generation is open:
        # they share the model's tap hooks (a caller of its own, as the bench, beside the worker)
        with self._warm_guard:
            self._open_streams += 1
        try:
            yield from self._stream(prompt_ids, params)
        finally:
            with self._warm_guard:
                self._open_streams -= 1

    def _stream(self, prompt_ids: list[int], params: GenerationParams) -> Iterator[StepEvent]:
        if not params.stop_token_ids:
            params = replace(params, stop_token_ids=tuple(self.eos_token_ids))
        check_draft_window(params.draft_window, self.capabilities.max_context)
        # plain decoding (block 1) runs without a drafter and collects no taps
        drafter = (self.make_drafter(params.draft_window)
                   if widest_block(params, self.pair.drafter_block) > 1 else None)
        runner = self.make_runner(collect_taps=drafter is not None)
        measured = self.calibration
        planner = speculative.default_planner(
            runner, drafter, prompt_ids, params, measured.costs if measured else None,
            measured.prior if measured else ())
        resume = self._resume(prompt_ids, runner, drafter)
        detokenizer = StreamDetokenizer(self.tokenizer)
        if self.round_trace is not None:
            self.round_trace.generation(prompt_tokens=len(prompt_ids), max_tokens=params.max_tokens,
                                        cached_tokens=resume.cached_rows if resume else 0)
        # closing: a client that stops reading ends the loop now, and its state is kept now
        with closing(speculative.generate(runner, drafter, prompt_ids, params, planner,
                                          resume, self.round_trace)) as events:
            for event in events:
                # how much of the text the drafter's accepted tokens made, then a lookup
                # draft's: a client colours exactly what each wrote
                text, (drafter_chars, accepted_chars) = detokenizer.add_split(
                    event.token_ids, (event.accepted - event.lookup_accepted, event.accepted))
                yield replace(event, text=text, accepted_chars=accepted_chars,
                              lookup_accepted_chars=accepted_chars - drafter_chars)

    def warm_next_turn(self, messages: list[dict], reply: str, prompt_ids: list[int],
                       params: GenerationParams, thinking: bool | None,
                       should_stop: Callable[[], bool]) -> bool:
        ids = next_turn_ids(self.tokenizer, messages, reply, prompt_ids, thinking)
        return ids is not None and warm(
            self, ids, params, lambda: self._open_streams > 0 or should_stop(), self._warm_guard)

    def _resume(self, prompt_ids: list[int], runner: TargetRunner,
                drafter: Drafter | None) -> Resume | None:
        """The longest kept prefix of the prompt, restored into this generation's runner and
        drafter, and where the generation's own state goes when it ends."""
        cache, states = self.prefix_cache, self.prefix_states
        if cache is None or states is None or not states.accepts(drafter):
            return None
        hit = cache.lookup(prompt_ids, needs_taps=drafter is not None)
        resume = Resume(keep_prompt=states.keeps_prompt(runner))
        if hit is not None:
            resume.unseen_taps = states.restore(hit.entry.kept, hit.rows, runner, drafter)
            resume.cached_rows = hit.rows

        def keep(row_ids: list[int], unseen_taps) -> None:
            kept = states.snapshot(runner, drafter, unseen_taps)
            if isinstance(kept, str):
                if self.prefix_cache_note is None:
                    log.warning("prefix cache: %s", kept)
                self.prefix_cache_note = kept
                return
            cache.store(row_ids, kept)

        resume.keep = keep
        return resume


TOO_LONG_MARGIN = 2  # counted in chunks, a prompt refused early is surely too long
COUNT_WHOLE_UNDER_CHARS_PER_TOKEN = 8  # content shorter than this many characters per context token
COUNT_CHUNK_CHARS = 16_384


def chat_prompt_ids(tokenizer, messages: list[dict], thinking: bool | None = None,
                    tools: list[dict] | None = None, assistant_prefix: str = "",
                    generation_prompt: bool = True) -> list[int]:
    """The ids of messages under the tokenizer's chat template, ready for the assistant's turn:
    one encoding for what the engines serve and what a drafter is trained on.
    `generation_prompt=False`: the conversation as history, its last message closed (what the
    next request's prompt begins with: engines/turn_warmup.py).

    What the client wrote is text: a "<|im_end|>" in a message, a tool's description or schema,
    a call's arguments or a tool's result is tokenized as those characters, never as the control
    token, so only the template's own markup ends or opens a turn (client_text.py). Values free
    of special-token text are encoded exactly as the rendered template.
    `tools` go to the template as its `tools`; `assistant_prefix` (template text, e.g. a forced
    tool call's opener) follows the generation prompt. An assistant message that only calls
    tools may have no content (None or "")."""
    check_texts(messages, tools)
    return _prompt_ids_of_checked(tokenizer, messages, thinking, tools, assistant_prefix,
                                   generation_prompt)


def _prompt_ids_of_checked(tokenizer, messages: list[dict], thinking: bool | None = None,
                            tools: list[dict] | None = None, assistant_prefix: str = "",
                            generation_prompt: bool = True) -> list[int]:
    """chat_prompt_ids of messages and tools whose texts `check_texts` has already passed."""
    marked = mark_special_texts(tokenizer, messages, tools)
    if marked is None:
        return tokenizer.encode(chat_text(tokenizer, messages, thinking, generation_prompt, tools)
                                + assistant_prefix, add_special_tokens=False)
    rendered = chat_text(tokenizer, marked.messages, thinking, generation_prompt, marked.tools)
    return encode_marked(tokenizer, rendered + assistant_prefix, marked.texts)


def chat_text(tokenizer, messages: list[dict], thinking: bool | None = None,
              generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
    """The chat template's text of the messages (thinking on/off where it has the switch)."""
    extra = {} if thinking is None else {"enable_thinking": thinking}
    if tools:
        extra["tools"] = list(tools)
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=generation_prompt, **extra)


def next_turn_ids(tokenizer, messages: list[dict], reply: str, prompt_ids: list[int],
                  thinking: bool | None = None) -> list[int] | None:
    """The ids the next request of this conversation begins with: the messages and the reply
    as history, closed by the template's end of turn, encoded as chat_prompt_ids encodes a
    prompt. None where the template writes the history otherwise than the prompt it extends
    (one that drops an earlier turn's reasoning): nothing kept would be reused.
    The messages are a request's, whose texts its prompt's encoding checked, and the reply is
    decoded text: neither is checked again."""
    history = [*messages, {"role": "assistant", "content": reply}]
    if not chat_text(tokenizer, history, thinking, generation_prompt=False).startswith(
            chat_text(tokenizer, messages, thinking)):
        return None
    ids = _prompt_ids_of_checked(tokenizer, history, thinking, generation_prompt=False)
    return ids if len(ids) > len(prompt_ids) else None


def unicode_problem(text: str) -> str | None:
    """What makes `text` unencodable: JSON's "\\ud800" gives Python a lone surrogate, which no
    tokenizer can encode; None when it is valid Unicode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"character {exc.start} is a lone surrogate ({text[exc.start]!a}): not valid Unicode text"
    return None


def content_of(message: dict) -> str:
    """A message's text; "" for an assistant's tool-calls-only message (content None)."""
    return message.get("content") or ""


def check_texts(messages: list[dict], tools: list[dict] | None = None) -> None:
    """Refuse text no tokenizer can encode, naming where it is: every string the template may
    render (a tool's schema and a call's arguments are any JSON, unchecked by the request's)."""
    for name, value in (("messages", messages), ("tools", tools or [])):
        for where, text in client_strings(value, name):
            if (problem := unicode_problem(text)) is not None:
                raise InvalidRequestError(f"{where}: {problem}")


def check_prompt_length(tokenizer, messages: list[dict], max_context: int) -> None:
    """Refuse a prompt far past the context without tokenizing all of it (10 MB would hold the
    worker for seconds): long content is counted a chunk at a time, stopping once it is surely
    too long. Chunks counted apart miss at most a merge or two at each cut, hence the margin."""
    chars = sum(len(content_of(message)) for message in messages)
    if chars <= max_context * COUNT_WHOLE_UNDER_CHARS_PER_TOKEN:
        return  # tokenizing it whole is cheap: the exact check comes after
    counted, seen = 0, 0
    for message in messages:
        content = content_of(message)
        for start in range(0, len(content), COUNT_CHUNK_CHARS):
            chunk = content[start:start + COUNT_CHUNK_CHARS]
            counted += len(tokenizer.encode(chunk, add_special_tokens=False,
                                            split_special_tokens=True))
            seen += len(chunk)
            if counted > TOO_LONG_MARGIN * max_context:
                raise PromptTooLongError(
                    f"prompt of {chars} characters has over {counted} tokens in its first {seen} "
                    f"characters alone: far past the target's context of {max_context} tokens")


def generation_config_eos(target_dir: Path | None) -> list[int]:
    """The eos ids a target's generation_config.json lists (one id or a list; [] without one)."""
    path = target_dir / "generation_config.json" if target_dir is not None else None
    if path is None or not path.is_file():
        return []
    try:
        eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, ValueError, AttributeError) as exc:
        log.warning("%s is unreadable (%s): stopping on the tokenizer's end tokens only", path, exc)
        return []
    return eos_id_list(eos)


def eos_id_list(eos) -> list[int]:
    """A generation config's eos_token_id (None, one id or a list) as a list of ids."""
    eos = eos if isinstance(eos, list) else [eos]
    return [token_id for token_id in eos if isinstance(token_id, int) and not isinstance(token_id, bool)]


def end_of_turn_ids(tokenizer, generation_eos: Sequence[int] = ()) -> list[int]:
    """The ids that end an assistant turn: the tokenizer's eos, the target's own generation
    config's (`generation_eos`: what its authors stop on, e.g. SmolLM2's <|endoftext|>, which is
    also its unknown token) and the chat-template end markers the tokenizer knows (never its
    unknown-token id otherwise): where a generation stops, served or regenerated."""
    ids = []
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    ids += [int(token_id) for token_id in generation_eos if int(token_id) not in ids]
    # harmony (gpt-oss): <|return|> ends a reply, <|call|> a turn that calls a tool
    for token in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>", "<|return|>",
                  "<|call|>"):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id and token_id not in ids:
            ids.append(token_id)
    return ids
