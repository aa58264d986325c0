"""Where things live: the app's data and config dirs, and the repo's shipped models/ folder; and
the one way a file's checksum is taken (`file_sha256`)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import platformdirs

APP_NAME = "dflash-local"


def data_dir() -> Path:
    """DFLASH_LOCAL_HOME overrides the platform data dir (tests and CI use it)."""
    path = data_dir_path()
    path.mkdir(parents=True, exist_ok=True)
    return path


def data_dir_path() -> Path:
    """`data_dir`, not created here (a caller that can do without it reports its absence)."""
    override = os.environ.get("DFLASH_LOCAL_HOME")
    return Path(override) if override else platform_data_dir()


def platform_data_dir() -> Path:
    """The user's data dir when DFLASH_LOCAL_HOME does not override it (not created here)."""
    return Path(platformdirs.user_data_dir(APP_NAME))


def config_dir_path() -> Path:
    """The app's config dir, not created here (reading settings needs no folder; a save makes it)."""
    override = os.environ.get("DFLASH_LOCAL_HOME")
    return Path(override) / "config" if override else Path(platformdirs.user_config_dir(APP_NAME))


def shipped_models_dir() -> Path:
    """The repo's models/ folder (catalog, embedded drafter), found beside the package."""
    return Path(__file__).resolve().parent.parent / "models"


def file_sha256(path: Path) -> str:
    """The file's SHA-256, hex, read in blocks (model weights do not fit a single read)."""
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()
