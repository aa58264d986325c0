"""A client's text inside a chat prompt stays text: only the template's own markup is control tokens.

Everything a client sends that a chat template renders (message content, tool definitions with
their parameter schemas, an assistant's tool calls and their arguments, tool results and call
ids) may hold a special token's text: a pasted "<|im_end|><|im_start|>system ...". Encoded with
the rendered template, that text would become the control tokens and open a turn the client
does not own. So before the template renders them, each special token's text in the client's
values is swapped for a private-use mark, which the template passes through wherever it puts the
value (as it is, or inside `tojson`, which escapes neither the mark nor a special token's text);
the rendered prompt is then encoded piece by piece, each mark as the text it stands for with
split_special_tokens=True. Values free of special-token text are not marked at all: their prompt
is the rendered template encoded whole, as before.
A template may also spell a special token around a value: Qwen3-Coder-style templates write a
parameter's extra keys as XML tags ('<' ~ key ~ '>'), so a key "|im_start|" would open a turn.
A key that a "<" or "</" before it, or a ">" after it, would complete into special text is
marked whole, as the text it is.
A template that rewrites a value instead of passing it through (slices it, re-cases it, escapes
it as ASCII, prints a dict's repr) breaks its marks: such a request is refused, naming the
special text, rather than sending the target a mangled mark.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dflash_local.errors import InvalidRequestError

# private-use characters: no chat template or tokenizer gives them a meaning
SPECIAL_MARK = "\ue000dflash-special-{}\ue001"
SPECIAL_MARK_SPLIT = re.compile("\ue000dflash-special-(\\d+)\ue001")
MARK_OPEN = "\ue000"  # marked too once marks are in use, so no client text can forge a mark
# what is left of a mark the template rewrote: its opener (no client text holds one raw), or the
# mark escaped as ASCII ("\\ue000dflash-special-0\\ue001" from tojson(ensure_ascii=True))
BROKEN_MARK = re.compile("\ue000|\\\\ue000dflash-special", re.IGNORECASE)


@dataclass(frozen=True)
class _Specials:
    size: int  # the tokenizer's size when they were worked out
    texts: frozenset[str]
    found: re.Pattern[str] | None  # any of the texts, longest first; None: the tokenizer has none
    marked: re.Pattern[str]  # any of the texts, or MARK_OPEN
    found_at_end: re.Pattern[str] | None  # any of the texts, ending where the string ends
    longest: int  # the longest text's length


# tokenizer -> its special texts: worked out once, not per request
_SPECIALS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _specials(tokenizer) -> _Specials:
    size = len(tokenizer)
    kept = _SPECIALS.get(tokenizer)
    if kept is None or kept.size != size:
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        texts = frozenset(({token.content for token in added.values() if getattr(token, "special", False)}
                           | set(getattr(tokenizer, "all_special_tokens", ()))) - {""})
        kept = _SPECIALS[tokenizer] = _Specials(
            size, texts, re.compile(trie_regex(texts)) if texts else None,
            re.compile(trie_regex(texts | {MARK_OPEN})),
            re.compile(f"(?:{trie_regex(texts)})\\Z") if texts else None,
            max(map(len, texts), default=0))
    return kept


# what a template writes right around a key to make a tag of it (XML-style tool prompts)
TAG_OPENERS, TAG_CLOSER = ("<", "</"), ">"
KEY = " (a key)"  # how client_strings says a string is a dict's key


def _completes_special(specials: _Specials, text: str) -> bool:
    """Whether a tag's "<" or "</" before `text`, or its ">" after, would make special text
    with the text's own first or last characters (only those near the ends are looked at)."""
    if specials.found is None:
        return False
    # a special text begun by the opener ends within its length: the closer counts for a short one
    head, tail = text[:specials.longest] + TAG_CLOSER, text[-specials.longest:] + TAG_CLOSER
    return (any(specials.found.match(opener + head) for opener in TAG_OPENERS)
            or specials.found_at_end.search(tail) is not None)


def trie_regex(texts: frozenset[str]) -> str:
    """A regex matching any of the texts, the longest where several start at one place, as a
    trie: texts share their prefixes ("<|reserved_200017|>"), so a search looks at a handful of
    characters per position, where one alternative per text would try each (a thousand of them,
    seconds on a 4 MB body)."""
    trie: dict = {}
    for text in texts:
        node = trie
        for char in text:
            node = node.setdefault(char, {})
        node[""] = {}  # a text ends here

    def pattern(node: dict) -> str:
        branches = [re.escape(char) + pattern(child) for char, child in sorted(node.items()) if char]
        if not branches:
            return ""
        ends_here = "" in node
        body = branches[0] if len(branches) == 1 and not ends_here else f"(?:{'|'.join(branches)})"
        return body + ("?" if ends_here else "")  # greedy: the longer text first

    return pattern(trie)


def special_token_texts(tokenizer) -> frozenset[str]:
    """The texts the tokenizer would turn into special (control) tokens; kept per tokenizer,
    worked out again only when tokens were added to it since."""
    return _specials(tokenizer).texts


def strings_in(value: Any) -> Iterator[tuple[str, bool]]:
    """(text, whether it is a dict's key) for every string in a JSON-like value. Walked with a
    stack, not recursion: a value nested 90 deep costs its size, where generators nested per
    level cost its size times its depth (seconds for a 3 MB tool schema)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item, False
        elif isinstance(item, dict):
            for key in item:
                if isinstance(key, str):
                    yield key, True
            stack.extend(reversed(item.values()))
        elif isinstance(item, list | tuple):
            stack.extend(reversed(item))


def client_strings(value: Any, where: str = "") -> Iterator[tuple[str, str]]:
    """(where, text) for every string in a JSON-like value, dict keys included: where is the
    path to it ("[1].tool_calls[0].function.arguments.city"). Each path costs its depth: for
    naming a string found by `strings_in`."""
    stack = [(where, value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, str):
            yield where, item
        elif isinstance(item, dict):
            children = []
            for key, child in item.items():
                path = f"{where}.{key}" if isinstance(key, str) else f"{where}[{key!r}]"
                if isinstance(key, str):
                    children.append((f"{path}{KEY}", key))
                children.append((path, child))
            stack.extend(reversed(children))
        elif isinstance(item, list | tuple):
            stack.extend(reversed([(f"{where}[{index}]", child) for index, child in enumerate(item)]))


@dataclass(frozen=True)
class MarkedValues:
    """A request's messages and tools with special-token text marked, and what each mark means."""

    messages: list[dict]
    tools: list[dict] | None
    texts: tuple[str, ...]  # mark N stands for texts[N]
    extra: tuple[str, ...] = ()  # the extra texts, marked


def mark_special_texts(tokenizer, messages: list[dict], tools: list[dict] | None,
                       extra: tuple[str, ...] = ()) -> MarkedValues | None:
    """The values with every special token's text in their strings marked (a key a tag's
    markup would complete into special text, whole); None when none holds any (their prompt is
    the template's text encoded whole). `extra`: client texts written outside the template (a
    forced call's name), marked alike."""
    specials = _specials(tokenizer)
    if specials.found is None or not any(
            specials.found.search(text) or (is_key and _completes_special(specials, text))
            for text, is_key in strings_in([messages, tools or [], list(extra)])):
        return None
    numbers: dict[str, int] = {}

    def mark_of(text: str) -> str:
        return SPECIAL_MARK.format(numbers.setdefault(text, len(numbers)))

    def marked(value: Any) -> Any:
        if isinstance(value, str):
            return specials.marked.sub(lambda found: mark_of(found[0]), value)
        if isinstance(value, dict):
            return {(mark_of(key) if isinstance(key, str) and _completes_special(specials, key)
                     else marked(key)): marked(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [marked(item) for item in value]
        return value

    marked_extra = tuple(marked(list(extra)))
    return MarkedValues(marked(messages), marked(tools) if tools else tools, tuple(numbers),
                        marked_extra)


def encode_marked(tokenizer, rendered: str, texts: tuple[str, ...]) -> list[int]:
    """The ids of a template's text rendered from marked values: its own text as the tokenizer
    encodes it (markup becomes control tokens), each mark as the text it stands for."""
    ids: list[int] = []
    for position, piece in enumerate(SPECIAL_MARK_SPLIT.split(rendered)):  # text, mark, text...
        if position % 2:
            ids += tokenizer.encode(texts[int(piece)], add_special_tokens=False,
                                    split_special_tokens=True)
        elif BROKEN_MARK.search(piece):
            raise InvalidRequestError(
                f"the target's chat template rewrites client text that holds special-token text "
                f"({', '.join(map(repr, texts[:3]))}) instead of passing it through, so it cannot "
                "stay plain text in the prompt: leave the special-token text out of the request")
        elif piece:
            ids += tokenizer.encode(piece, add_special_tokens=False)
    return ids
