"""Resolving model names to local directories through huggingface_hub (its cache, HF_HOME,
offline mode). A name is a local directory or a hub repo id; nothing else."""

from __future__ import annotations

import re
from pathlib import Path

from dflash_local.errors import ModelNotFoundError

REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
WEIGHT_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt", "*.tiktoken"]


def is_repo_id(name: str) -> bool:
    return bool(REPO_ID.match(name)) and ".." not in name


def resolve_model(name: str, revision: str | None = None, local_only: bool = False) -> Path:
    """A local directory as it is; a repo id from the hub cache, downloading unless local_only."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path.resolve()
    if not is_repo_id(name):
        raise ModelNotFoundError(f"{name!r} is neither a local directory nor a hub repo id (owner/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(name, revision=revision, allow_patterns=WEIGHT_PATTERNS,
                                      local_files_only=True))
    except LocalEntryNotFoundError:
        if local_only:
            raise ModelNotFoundError(f"{name} is not in the local Hugging Face cache") from None
    try:
        return Path(snapshot_download(name, revision=revision, allow_patterns=WEIGHT_PATTERNS))
    except RepositoryNotFoundError:
        raise ModelNotFoundError(f"the Hugging Face hub has no repo {name!r} (or it is gated)") from None
    except LocalEntryNotFoundError:
        raise ModelNotFoundError(
            f"cannot download {name}: the Hugging Face hub is unreachable (offline) and the repo "
            f"is not in the local cache"
        ) from None
    except OSError as exc:
        raise ModelNotFoundError(f"cannot download {name}: {exc}") from None
