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


def export_markdown(chat: Chat, messages: list[Message]) -> str:
    """A chat as a Markdown document: title, system prompt, then each turn; a reply's reasoning
    comes before its answer, in a collapsed `<details>` block titled "Reasoning"."""
    parts = [f"# {chat.title}\n"]
    if chat.system_prompt:
        parts.append(f"> System: {chat.system_prompt}\n")
    for message in messages:
        heading = "You" if message.role == "user" else "Assistant"
        if message.status not in ("done", "streaming"):
            heading += f" ({message.status})"
        reasoning = message.meta.get("reasoning", "").strip()
        details = REASONING_DETAILS.format(reasoning) if reasoning else ""
        parts.append(f"## {heading}\n\n{details}{message.content}\n")
    return "\n".join(parts)
