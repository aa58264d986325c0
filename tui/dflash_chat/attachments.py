"""`@path` in a prompt attaches a text file: the file's contents follow the prompt in a fenced
block named after it. A word after `@` that names no file (a handle, a decorator) is left as
typed.

Boundary: pure Python, no Textual.
"""

from __future__ import annotations

import re
from pathlib import Path

ATTACHMENT = re.compile(r"(?<!\S)@(\S+)")
TRAILING = ".,;:!?)'\""  # punctuation after a path belongs to the sentence
MAX_ATTACHMENT_BYTES = 256 * 1024  # a prompt, not a corpus: larger files would not fit a context


class AttachmentError(ValueError):
    pass


def expand_attachments(prompt: str, cwd: Path) -> str:
    """The prompt with each `@path` naming a file followed by that file's contents."""
    blocks = []
    for match in ATTACHMENT.finditer(prompt):
        word = match.group(1)
        for name in dict.fromkeys((word, word.rstrip(TRAILING))):  # "see @notes.txt, then"
            path = (cwd / Path(name).expanduser()).resolve()
            if path.is_file():
                blocks.append(f"{name}:\n\n```\n{read_text_file(path)}\n```")
                break
    return "\n\n".join([prompt, *blocks])


def read_text_file(path: Path) -> str:
    size = path.stat().st_size
    if size > MAX_ATTACHMENT_BYTES:
        raise AttachmentError(f"@{path}: {size} bytes is more than the {MAX_ATTACHMENT_BYTES} "
                              f"an attachment may have")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise AttachmentError(f"@{path}: not UTF-8 text (byte {exc.start})") from None
    if "\x00" in text:
        raise AttachmentError(f"@{path}: a binary file (it holds NUL bytes)")
    return text.rstrip("\n")
