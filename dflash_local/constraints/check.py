"""Is a constraint usable, before any tokenizer or queue: the check every API runs first.
It compiles the grammar against a 257-token byte vocabulary, which is enough to find a bad
schema, an unsupported keyword, a regex or grammar that does not parse or cannot match, and a
compile past the caps; what it finds is an InvalidRequestError naming the field and the reason."""

from __future__ import annotations

import functools
import time

from dflash_local.constraints import grammar
from dflash_local.constraints.grammar import grammar_text, parser_limits
from dflash_local.errors import InvalidRequestError
from dflash_local.events import OutputConstraint

_KIND_WORDS = {"json_schema": "JSON Schema", "json_object": "JSON object", "regex": "regex",
               "lark": "Lark grammar"}


def check_constraint(constraint: OutputConstraint, field: str = "constraint") -> None:
    """Raise InvalidRequestError ("{field}: invalid regex: ...") unless `constraint` compiles
    within the caps and admits some text. `field`: the request's path to it, for the message."""
    _checked(constraint.kind, constraint.source, field)


@functools.lru_cache(maxsize=256)
def _checked(kind: str, source: str, field: str) -> None:
    """Cached by value: an agent sends the same schema with every request."""
    import llguidance

    constraint = OutputConstraint(kind, source)
    what = _KIND_WORDS[kind]
    definition = grammar_text(constraint, field)
    start = time.perf_counter()
    matcher = llguidance.LLMatcher(_byte_tokenizer(), definition, log_level=0, limits=parser_limits())
    matcher.compute_bitmask()  # the first mask finds a language with no text in it
    elapsed = time.perf_counter() - start
    if matcher.is_error():
        raise InvalidRequestError(f"{field}: {_reason(what, matcher)}")
    if elapsed > grammar.COMPILE_CAP_S:
        raise InvalidRequestError(f"{field}: the {what} took {elapsed:.1f} s to compile, over "
                                  f"the cap of {grammar.COMPILE_CAP_S} s")


def _reason(what: str, matcher) -> str:
    """The matcher's error in a sentence: its first line, without the state dump."""
    detail = matcher.get_error().strip()
    if detail.startswith("NoExtension"):
        return f"the {what} cannot match any text"
    if "TooComplex" in detail or "limit" in detail.lower():
        return f"the {what} is too complex to compile within the limits ({detail.split()[0]})"
    detail = " ".join(line.strip() for line in detail.splitlines()[:4] if line.strip())
    if detail.startswith("Unimplemented keys"):
        return f"unsupported JSON Schema keyword(s): {detail.partition(':')[2].strip()}"
    return f"invalid {what}: {detail}"


@functools.cache
def _byte_tokenizer():
    """One token per byte and an end token: enough vocabulary to compile any grammar."""
    import llguidance

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary()))


class _ByteVocabulary:
    """What llguidance.TokenizerWrapper reads: tokens as bytes, the end token, an encoder."""

    def __init__(self):
        self.eos_token_id, self.bos_token_id = 256, None
        self.tokens = [bytes([value]) for value in range(256)] + [b"</s>"]
        self.special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)
