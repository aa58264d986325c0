"""Model names to local directories through huggingface_hub (its cache, HF_HOME, offline mode),
and huggingface_hub's errors as ours. A name is a local directory or a hub repo id.

Boundary: resolve names and translate the hub's errors. Estimating memory is memory_fit.py's job,
downloading in the background hub_download.py's, loading the engines'.
"""

from __future__ import annotations

import re
from pathlib import Path

from dflash_local.errors import ModelNotFoundError
from dflash_local.pairs.snapshot_manifest import IncompleteSnapshotError, check_complete

REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
WEIGHT_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt", "*.tiktoken"]


def is_repo_id(name: str) -> bool:
    return bool(REPO_ID.match(name)) and ".." not in name


def resolve_model(name: str, revision: str | None = None, local_only: bool = False,
                  cache_dir: str | Path | None = None) -> Path:
    """A local directory as it is; a repo id from the hub cache, downloading unless local_only."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path.resolve()
    if not is_repo_id(name):
        raise ModelNotFoundError(f"{name!r} is neither a local directory nor a hub repo id (owner/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        cached = Path(snapshot_download(name, revision=revision, allow_patterns=WEIGHT_PATTERNS,
                                        local_files_only=True, cache_dir=cache_dir))
        return check_complete(cached, name)
    except IncompleteSnapshotError:
        if local_only:
            raise
    except LocalEntryNotFoundError:
        if local_only:
            raise ModelNotFoundError(f"{name} is not in the local Hugging Face cache") from None
    try:
        return Path(snapshot_download(name, revision=revision, allow_patterns=WEIGHT_PATTERNS,
                                      cache_dir=cache_dir))
    except RepositoryNotFoundError:
        raise ModelNotFoundError(f"the Hugging Face hub has no repo {name!r} (or it is gated)") from None
    except LocalEntryNotFoundError:
        raise ModelNotFoundError(
            f"cannot download {name}: the Hugging Face hub is unreachable (offline) and the repo "
            f"is not in the local cache"
        ) from None
    except OSError as exc:
        raise ModelNotFoundError(f"cannot download {name}: {exc}") from None


# what huggingface_hub raises for a missing, gated, unreachable or offline repo (its HTTP and
# cache errors are OSErrors; a malformed repo id is a ValueError)
HUB_ERRORS = (OSError, ValueError)


def hub_error(repo: str, exc: Exception) -> ModelNotFoundError:
    """One clear message for what huggingface_hub raised while fetching `repo`."""
    from huggingface_hub.errors import DryRunError

    if isinstance(exc, DryRunError) and exc.__cause__ is not None:
        exc = exc.__cause__  # the dry run wraps the error it met listing the repo
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, GatedRepoError):
        return ModelNotFoundError(f"{repo} is gated on the Hugging Face hub: accept its license "
                                  f"and log in with an HF token")
    if isinstance(exc, RepositoryNotFoundError):
        return ModelNotFoundError(f"the Hugging Face hub has no repo {repo!r} (or it is private)")
    if isinstance(exc, RevisionNotFoundError):
        return ModelNotFoundError(f"{repo} has no such revision: {exc}")
    if constants.HF_HUB_OFFLINE:
        return ModelNotFoundError(f"cannot download {repo}: offline mode is on (HF_HUB_OFFLINE=1) "
                                  f"and it is not in the local cache")
    if isinstance(exc, HfHubHTTPError):
        return ModelNotFoundError(f"cannot download {repo}: the hub answered {exc}")
    if isinstance(exc, LocalEntryNotFoundError) or "connect" in type(exc).__name__.lower():
        return ModelNotFoundError(f"cannot download {repo}: the Hugging Face hub is unreachable "
                                  f"and it is not in the local cache")
    return ModelNotFoundError(f"cannot download {repo}: {type(exc).__name__}: {exc}")
