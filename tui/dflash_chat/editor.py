"""Edit a prompt in the user's editor ($VISUAL, else $EDITOR, else vi) through a temp file.

Boundary: no Textual (the screen hands the terminal over around `edit_text`).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import tempfile
from pathlib import Path


class EditorError(RuntimeError):
    pass


def editor_command() -> list[str]:
    return shlex.split(os.environ.get("VISUAL") or os.environ.get("EDITOR") or "vi")


def edit_text(text: str) -> str:
    """`text` as the editor left it (one trailing newline, which editors add, dropped)."""
    command = editor_command()
    with tempfile.TemporaryDirectory(prefix="dflash-chat-") as folder:
        path = Path(folder) / "prompt.md"
        path.write_text(text, encoding="utf-8")
        try:
            result = subprocess.run([*command, str(path)], check=False)
        except OSError as exc:
            raise EditorError(f"editor {command[0]!r} could not run: {exc}") from None
        if result.returncode != 0:
            raise EditorError(f"editor {command[0]!r} exited with status {result.returncode}; "
                              f"the prompt is unchanged")
        edited = path.read_text(encoding="utf-8")
    return edited.removesuffix("\n")
