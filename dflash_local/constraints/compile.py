"""Constraints compiled for one engine's tokenizer: the tokenizer's llguidance twin, built once,
and each constraint's matcher, compiled once and copied for every generation."""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict

from dflash_local.constraints.check import check_constraint
from dflash_local.constraints.grammar import grammar_text, parser_limits
from dflash_local.constraints.matcher import LLGuidanceGrammar
from dflash_local.errors import InvalidRequestError
from dflash_local.events import OutputConstraint

CACHED_CONSTRAINTS = 64  # an agent's few schemas, each compiled once


class ConstraintCompiler:
    """`grammar(constraint)` for a Hugging Face fast tokenizer (both local engines load one)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._llg_tokenizer = None  # built at the first constrained request (~0.2-1 s)
        self._twin_refused: str | None = None  # why it could not be built, said to every request
        self._compiled: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()  # the worker and a bench may compile at once

    def grammar(self, constraint: OutputConstraint, field: str = "constraint") -> LLGuidanceGrammar:
        """A fresh matcher for one generation; InvalidRequestError for a bad constraint."""
        check_constraint(constraint, field)
        with self._lock:
            tokenizer = self._tokenizer_twin()
            key = (constraint.kind, constraint.source)
            compiled = self._compiled.pop(key, None) or self._compile(constraint, field, tokenizer)
            self._compiled[key] = compiled
            while len(self._compiled) > CACHED_CONSTRAINTS:
                self._compiled.popitem(last=False)
        return LLGuidanceGrammar(compiled.deep_copy(), tokenizer.vocab_size, tokenizer.eos_tokens)

    def _compile(self, constraint: OutputConstraint, field: str, tokenizer):
        import llguidance

        matcher = llguidance.LLMatcher(tokenizer, grammar_text(constraint, field), log_level=0,
                                       limits=parser_limits())
        if matcher.is_error():
            raise InvalidRequestError(f"{field}: {matcher.get_error().splitlines()[0]}")
        return matcher

    def _tokenizer_twin(self):
        if self._llg_tokenizer is None and self._twin_refused is None:
            try:
                self._llg_tokenizer = llguidance_tokenizer(self._tokenizer)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # noqa: BLE001 (a Rust panic is a BaseException)
                reason = (str(exc).splitlines() or [type(exc).__name__])[0]
                self._twin_refused = (f"constrained output is not available for this target's "
                                      f"tokenizer (the grammar engine refused it: {reason})")
        if self._twin_refused is not None:
            raise InvalidRequestError(self._twin_refused)
        return self._llg_tokenizer


def llguidance_tokenizer(tokenizer):
    """llguidance's tokenizer from a Hugging Face fast tokenizer's own definition (added
    tokens included); its end token is the tokenizer's. llguidance reads every added token as
    a special one, which no grammar's text can spell: an added token that is not special
    (Qwen's <tool_call>) is made text again, so a grammar's "<tool_call>" takes it."""
    import llguidance

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise InvalidRequestError(f"constrained output needs a fast tokenizer; this target's is "
                                  f"{type(tokenizer).__name__}")
    backend = copy.copy(backend)  # padding and truncation off on a copy, not the engine's
    backend.no_padding()
    backend.no_truncation()
    parsed = llguidance.LLTokenizer(backend.to_str(), n_vocab=len(tokenizer),
                                    eos_token=tokenizer.eos_token_id)
    special = {token_id for token_id, added in tokenizer.added_tokens_decoder.items() if added.special}
    if all(token_id in special for token_id in range(len(tokenizer)) if parsed.is_special_token(token_id)):
        return parsed
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(parsed, tokenizer, special)))


class _Vocabulary:
    """What llguidance.TokenizerWrapper reads: each token's bytes as llguidance parsed them,
    only the tokenizer's own special tokens marked special, and the tokenizer as encoder."""

    def __init__(self, parsed, tokenizer, special: set[int]):
        self.eos_token_id, self.bos_token_id = tokenizer.eos_token_id, tokenizer.bos_token_id
        self.tokens = [parsed.decode_bytes([token_id]) for token_id in range(len(tokenizer))]
        self.special_token_ids = sorted(special | {tokenizer.eos_token_id})
        self._tokenizer = tokenizer

    def __call__(self, text: bytes) -> list[int]:
        return self._tokenizer.encode(text.decode("utf-8", errors="replace"), add_special_tokens=False)
