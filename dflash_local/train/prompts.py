"""Training and held-out prompts from data every machine has: the CPython standard library's
docstrings (found through sysconfig) plus hand-written chat prompts. Split deterministically."""

from __future__ import annotations

import ast
import functools
import hashlib
import random
import re
import sysconfig
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from dflash_local.errors import DFlashError

CHAT_PROMPTS = [
    "What is the capital of France, and what is it famous for?",
    "Explain photosynthesis to a ten-year-old.",
    "Write a short poem about the ocean at night.",
    "Give me three tips for staying focused while studying.",
    "What are the main differences between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "How do I make a simple tomato pasta sauce?",
    "Why is the sky blue?",
    "Write a friendly email inviting a colleague to lunch.",
    "What is machine learning? Explain it simply.",
    "List five healthy breakfast ideas.",
    "How does a bicycle stay upright when it moves?",
    "Explain the difference between weather and climate.",
    "Write a haiku about autumn leaves.",
    "What are the benefits of regular exercise?",
    "How do vaccines work?",
    "Describe the water cycle step by step.",
    "Give me a short motivational message for a Monday morning.",
    "What is the Pythagorean theorem? Give an example.",
    "How can I improve my public speaking skills?",
    "Explain what a black hole is.",
    "Write a short story about a robot who learns to paint.",
    "What is the difference between HTTP and HTTPS?",
    "How do I reverse a string in Python?",
    "What causes the seasons on Earth?",
    "Give me a recipe for chocolate chip cookies.",
    "Explain recursion with a simple example.",
    "What is the importance of sleep for health?",
    "Write a thank-you note to a teacher.",
    "How do plants get water from the soil to their leaves?",
    "What are prime numbers? List the first ten.",
    "Explain the rules of chess briefly.",
    "How does the internet work, in simple terms?",
    "What is the difference between a virus and a bacterium?",
    "Write a limerick about a cat.",
    "How can I save money on groceries?",
    "What is gravity?",
    "Explain how a compiler differs from an interpreter.",
    "What are some good habits for writing clean code?",
    "Describe a typical day in the life of a honeybee.",
    "Translate 'Good morning, how are you?' into Spanish and French.",
    "What is the tallest mountain in the world and how tall is it?",
    "Explain supply and demand with an example.",
    "Write a Python function that checks whether a number is prime.",
    "What is the difference between RAM and storage?",
    "How do I write a good resume?",
    "Explain the greenhouse effect.",
    "What are the planets in our solar system?",
    "Give me tips for learning a new language.",
    "How does a refrigerator keep food cold?",
    "Write a SQL query that selects all users older than 30.",
    "What is an API?",
    "Explain what DNA is.",
    "How can I reduce stress?",
    "Write a short dialogue between a customer and a barista.",
    "What is the speed of light?",
    "Explain the difference between a class and an object.",
    "What is a sorting algorithm? Describe bubble sort.",
    "How do airplanes fly?",
    "Describe the life cycle of a butterfly.",
    "Write a Python function to compute the factorial of n.",
    "What is inflation and why does it matter?",
    "How do I care for a houseplant?",
    "Explain what a neural network is.",
    "What is the boiling point of water at sea level?",
    "Give me three ideas for a birthday party.",
    "What is the difference between mean, median and mode?",
    "Write a JavaScript function that adds two numbers.",
    "Explain the French Revolution in a paragraph.",
    "How can I be more productive working from home?",
    "What is renewable energy? Give examples.",
    "How does a rainbow form?",
    "Write a short speech for a friend's wedding.",
    "What is a dictionary in Python and how do I use it?",
    "Explain how the heart pumps blood.",
    "What is the difference between git merge and git rebase?",
    "Give me a workout plan for beginners.",
    "What are the causes of earthquakes?",
    "Describe the taste of a lemon to someone who has never had one.",
    "How do I read a file line by line in Python?",
]

DEFAULT_LIMIT = 20000  # docstrings: more than the stdlib has, so the held-out set is all of its share

FRAMINGS = [
    "Explain what this Python code does:\n\n{code}",
    "Here is the documentation of a Python function. Explain it in simple words.\n\n{doc}",
    "Write a Python function that does the following: {summary}",
    "Summarize this text in one or two sentences:\n\n{doc}",
    "{summary} How would I do this in Python?",
]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def docstring_prompts(root: Path | None = None, limit: int = DEFAULT_LIMIT, seed: int = 0) -> list[str]:
    """Prompts framed around stdlib docstrings and short function sources: one per docstring."""
    return [group[0] for group in _docstring_groups(root, limit, seed)]


def variant_prompts(variants: int, root: Path | None = None, limit: int = DEFAULT_LIMIT, seed: int = 0) -> list[str]:
    """Up to `variants` more framings of each docstring whose first prompt is a training prompt
    (a held-out docstring never reaches training in another framing). More data from the same
    corpus without changing the first prompts, their split, or the benchmark's held-out set."""
    return _variants(_docstring_groups(root, limit, seed), variants)


def _variants(groups: Sequence[Sequence[str]], variants: int) -> list[str]:
    return [prompt for group in groups if not is_held_out(group[0]) for prompt in group[1 : 1 + variants]]


@functools.lru_cache(maxsize=4)  # the stdlib takes seconds to parse: once per process (immutable)
def _docstring_groups(root: Path | None, limit: int, seed: int) -> tuple[tuple[str, ...], ...]:
    """Per docstring: its first prompt (a seeded random framing), then the other framings."""
    root = root or stdlib_root()
    files = sorted(p for p in root.glob("*.py")) + sorted(root.glob("*/*.py"))
    if not files:
        raise DFlashError(f"no Python sources under {root}: cannot build the docstring corpus")
    rng = random.Random(seed)
    groups = []
    for path in files:
        folder = path.parent.relative_to(root).name  # "" at the top: the root's own name never counts
        if "test" in folder or path.name.startswith("test"):
            continue
        groups.extend(tuple(group) for group in _groups_from_file(path, rng))
        if len(groups) >= limit:
            break
    return tuple(groups[:limit])


def _groups_from_file(path: Path, rng: random.Random) -> list[list[str]]:
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):  # unreadable: not a docstring source
        return []
    groups = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.ClassDef):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc) < 40 or node.name.startswith("_"):
            continue
        summary = doc.strip().split("\n")[0].strip()
        code = ast.get_source_segment(source, node) or ""
        first = FRAMINGS.index(rng.choice(FRAMINGS))
        group = []
        for framing in FRAMINGS[first:] + FRAMINGS[:first]:
            if "{code}" in framing and (len(code) > 1200 or not code):
                framing = FRAMINGS[1]
            prompt = framing.format(code=code, doc=doc[:800], summary=summary)
            if prompt not in group:
                group.append(prompt)
        groups.append(group)
    return groups


def is_held_out(prompt: str, fraction: float = 0.05) -> bool:
    digest = hashlib.sha256(prompt.encode()).digest()
    return digest[0] < 256 * fraction


def split_prompts(prompts: list[str]) -> tuple[list[str], list[str]]:
    train = [p for p in prompts if not is_held_out(p)]
    held_out = [p for p in prompts if is_held_out(p)]
    return train, held_out


def all_prompts(limit: int = DEFAULT_LIMIT) -> list[str]:
    """Chat prompts first (each several times would overfit; once is enough), then docstrings."""
    return CHAT_PROMPTS + docstring_prompts(limit=limit)


def check_variant_range(variants: int, variants_from: int = 0) -> None:
    if variants < 0:
        raise DFlashError(f"prompt variants must be >= 0, got {variants}")
    if not 0 <= variants_from <= variants:
        raise DFlashError(f"--prompt-variants-from must be between 0 and --prompt-variants ({variants}), "
                          f"got {variants_from}")


def training_prompts(limit: int = DEFAULT_LIMIT, variants: int = 0, variants_from: int = 0,
                     corpus: Path | None = None) -> list[str]:
    """The training split, plus `variants` more framings per training docstring, without
    duplicates and without any prompt that is also a held-out one. With `variants_from` K > 0,
    only what framings K..`variants` add to that list (the earlier ones were regenerated into
    another data directory already), in the same order.

    `corpus`: another tree of Python sources (fresh data once the stdlib's framings are all
    regenerated). Its docstrings only, no chat prompts; a docstring that shares a prompt with a
    held-out stdlib docstring (a vendored copy) is dropped, so the benchmark's held-out set
    stays unseen."""
    check_variant_range(variants, variants_from)
    if corpus is None:
        groups, chat = _docstring_groups(None, limit, 0), CHAT_PROMPTS  # parsed once for both lists
    else:
        groups, chat = _unseen_groups(_docstring_groups(Path(corpus), limit, 0)), []
        if not groups:
            raise DFlashError(f"--prompt-corpus {corpus}: no usable docstring in {corpus}/*.py or "
                              f"{corpus}/*/*.py (a public function or class, 40+ characters)")
    prompts = _training_prompts(groups, variants, chat)
    if variants_from:
        already = set(_training_prompts(groups, variants_from - 1, chat))
        prompts = [p for p in prompts if p not in already]
    return prompts


NEAR_COPY = 0.5  # share of the smaller text's word 5-grams the two share: an edited copy
SHINGLE_WORDS = 5


def _unseen_groups(groups: Sequence[Sequence[str]]) -> list[Sequence[str]]:
    """Drop the groups that copy a held-out stdlib docstring (the benchmark's set): sharing a
    prompt with it, or (a vendored copy with edits, typing_extensions' `final` for typing's)
    sharing half the word 5-grams of the smaller of the two texts the framings carry."""
    held = [group for group in _docstring_groups(None, DEFAULT_LIMIT, 0) if is_held_out(group[0])]
    held_prompts = {prompt for group in held for prompt in group}
    held_shingles = [_shingles(group) for group in held]
    owners: dict[tuple[str, ...], list[int]] = {}
    for index, shingles in enumerate(held_shingles):
        for shingle in shingles:
            owners.setdefault(shingle, []).append(index)

    def copies_one(group: Sequence[str]) -> bool:
        shingles = _shingles(group)
        shared = Counter(index for shingle in shingles for index in owners.get(shingle, ()))
        return any(count >= NEAR_COPY * min(len(shingles), len(held_shingles[index]))
                   for index, count in shared.items())

    return [group for group in groups if held_prompts.isdisjoint(group) and not copies_one(group)]


def _shingles(group: Sequence[str]) -> set[tuple[str, ...]]:
    """Word 5-grams of what the group's framings carry (code, docstring, summary), not of the
    framings' own words, which every group shares."""
    words = re.findall(r"[a-z0-9]+", " ".join(_framed_text(prompt) for prompt in group).lower())
    return {tuple(words[i : i + SHINGLE_WORDS]) for i in range(len(words) - SHINGLE_WORDS + 1)}


# each framing's words before and after the text it carries
_FRAMING_ENDS = [framing.split(field) for framing in FRAMINGS
                 for field in ("{code}", "{doc}", "{summary}") if field in framing]


def _framed_text(prompt: str) -> str:
    for head, tail in _FRAMING_ENDS:
        if prompt.startswith(head) and prompt.endswith(tail) and len(prompt) >= len(head) + len(tail):
            return prompt[len(head) : len(prompt) - len(tail)]
    return prompt


def _training_prompts(groups: Sequence[Sequence[str]], variants: int, chat: list[str]) -> list[str]:
    train, held_out = split_prompts(chat + [group[0] for group in groups])
    excluded = set(held_out)
    prompts = dict.fromkeys(train)
    for prompt in _variants(groups, variants):
        if prompt not in excluded:
            prompts.setdefault(prompt)
    return list(prompts)
