"""A chat as text: a new chat's title, and the chat as a Markdown document (export).

Boundary: no Textual, no SQLite: it reads the store's dataclasses.
"""

from __future__ import annotations

from dflash_chat.storage import Chat, Message

TITLE_CHARS = 60
# blank lines inside: Markdown in the reasoning still renders where the block opens
REASONING_DETAILS = "<details><summary>Reasoning</summary>\n\n{}\n\n</details>\n\n"


def chat_title(prompt: str) -> str:
    """A new chat's title: the first line of its first prompt that has words."""
    line = next((line.strip() for line in prompt.splitlines() if line.strip()), "New chat")
    return line if len(line) <= TITLE_CHARS else line[:TITLE_CHARS - 1] + "…"


def distinct_title(title: str, taken: list[str]) -> str:
    """`title`, numbered ("… (2)") when another chat has it: chats that begin alike stay
    apart in the list and in search."""
    number = 1
    candidate = title
    while candidate in taken:
        number += 1
        candidate = f"{title} ({number})"
    return candidate


def export_markdown(chat: Chat, branch: list[Message], every: list[Message] | None = None) -> str:
    """A chat as a Markdown document: title, system prompt, then each turn of the branch shown;
    a reply's reasoning comes before its answer, in a collapsed `<details>` block titled
    "Reasoning". With `every` message, each other branch follows, from where it forks."""
    parts = [f"# {chat.title}\n"]
    if chat.system_prompt:
        parts.append(f"> System: {chat.system_prompt}\n")
    parts += [_message_markdown(message) for message in branch]
    written = {message.id for message in branch}
    children: dict[int | None, list[Message]] = {}
    for message in every or []:
        children.setdefault(message.parent_id, []).append(message)
    while fork := next((m for m in every or [] if m.id not in written and (
            m.parent_id in written or m.parent_id is None)), None):  # forks of forks too
        parts.append(f"---\n\n# Another version, {_after(fork, every or [])}\n")
        message: Message | None = fork
        while message is not None:  # down its newest replies, as the app shows a branch
            parts.append(_message_markdown(message))
            written.add(message.id)
            message = max(children.get(message.id, []), key=lambda m: m.id, default=None)
    return "\n".join(parts)


def _after(fork: Message, every: list[Message]) -> str:
    parent = next((m for m in every if m.id == fork.parent_id), None)
    if parent is None:
        return "from the start"
    words = " ".join(parent.content.split())
    return f"after: {words[:50]}…" if len(words) > 50 else f"after: {words}"


def _message_markdown(message: Message) -> str:
    heading = "You" if message.role == "user" else "Assistant"
    if message.status not in ("done", "streaming"):
        heading += f" ({message.status})"
    reasoning = message.meta.get("reasoning", "").strip()
    details = REASONING_DETAILS.format(reasoning) if reasoning else ""
    return f"## {heading}\n\n{details}{message.content}\n"
