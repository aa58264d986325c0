"""Constrained plain decoding, naively: the equality oracle of the constrained loop.

Each token comes from a fresh prefill of the whole sequence, its logits masked by an llguidance
matcher of the test's own (not the loop's Guide): what the grammar admits, the stop tokens only
where the text is a whole match. Also the schema every test reply must follow, and its check.
"""

from __future__ import annotations

import json

import llguidance
import numpy as np

from dflash_local.constraints.compile import llguidance_tokenizer
from dflash_local.constraints.grammar import grammar_text
from dflash_local.events import OutputConstraint

# bounded everywhere, so a random target finishes it within ~60 byte tokens
ANSWER_SCHEMA = {"type": "object", "properties": {
    "answer": {"enum": ["yes", "no", "maybe"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 99},
    "word": {"type": "string", "pattern": "^[a-z]{1,6}$"}},
    "required": ["answer", "count", "word"], "additionalProperties": False}
ANSWER = OutputConstraint("json_schema", json.dumps(ANSWER_SCHEMA))


def follows_answer_schema(text: str) -> bool:
    """The reply parses and validates against ANSWER_SCHEMA (no jsonschema package here)."""
    value = json.loads(text)
    return (set(value) == {"answer", "count", "word"} and value["answer"] in ("yes", "no", "maybe")
            and type(value["count"]) is int and 0 <= value["count"] <= 99
            and isinstance(value["word"], str) and 1 <= len(value["word"]) <= 6
            and value["word"].isascii() and value["word"].isalpha() and value["word"].islower())


class OracleMatcher:
    """A matcher of the test's own, and the mask the oracle applies."""

    def __init__(self, engine, constraint: OutputConstraint):
        self.tokenizer = llguidance_tokenizer(engine.tokenizer)
        self.matcher = llguidance.LLMatcher(self.tokenizer, grammar_text(constraint, "test"),
                                            log_level=0)
        self.stop_ids = list(engine.eos_token_ids)

    def allowed(self, width: int) -> np.ndarray:
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.zeros(width, dtype=bool)
        unpacked = np.unpackbits(bits, bitorder="little").astype(bool)[:width]
        allowed[: len(unpacked)] = unpacked
        allowed[self.tokenizer.eos_token] = False
        allowed[self.stop_ids] = self.matcher.is_accepting()
        return allowed


def target_logits(engine, ids: list[int]) -> np.ndarray:
    """The target's logits after `ids`, from a fresh runner's prefill [V]."""
    return np.asarray(engine.make_runner(collect_taps=False).prefill(list(ids))[0], dtype=np.float64)


def constrained_plain(engine, prompt_ids: list[int], constraint: OutputConstraint,
                      max_tokens: int) -> list[int]:
    """Greedy: each token the masked argmax; the stop token that ends the reply included."""
    oracle, output = OracleMatcher(engine, constraint), []
    while len(output) < max_tokens:
        logits = target_logits(engine, [*prompt_ids, *output])
        token = int(np.argmax(np.where(oracle.allowed(len(logits)), logits, -np.inf)))
        output.append(token)
        if token in oracle.stop_ids:
            break
        assert oracle.matcher.consume_token(token), oracle.matcher.get_error()
    return output
