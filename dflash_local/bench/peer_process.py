"""The Mac peers (dflash-mlx, mlx-dspark), each in a process of its own, run by a peer
environment's Python (scripts/setup_peers.sh) and driven over stdin/stdout (peer_driver.py).

The environment is a setting, never guessed: `--peer-python PATH` or DFLASH_PEER_PYTHON. Every
peer process first loads the OpenBLAS binding our process computes on, at our thread count, then
its peer with its own defaults, then with the drafter in float32: one process per row, alive for
the whole bench. A peer that cannot run (no environment, a refusal of our pair) stays in the
table with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from dflash_local.bench.measure import RunFigures
from dflash_local.errors import DFlashError
from dflash_local.events import GenerationParams

PEER_PYTHON_ENV = "DFLASH_PEER_PYTHON"
MAC_PEERS = ("dflash-mlx", "mlx-dspark")
DRAFTER_DTYPES = {"default": "its defaults", "float32": "drafter float32"}
NO_ENVIRONMENT = (f"n/a: no peer environment (scripts/setup_peers.sh makes one; then "
                  f"--peer-python PATH or {PEER_PYTHON_ENV}=PATH)")
STDERR_TAIL = 600  # characters of a dead peer's stderr quoted in its row


class PeerProcessError(DFlashError):
    """A peer process refused a request or died; the message says which and why."""


def peer_python_setting(flag: str | None) -> str | None:
    """--peer-python, else DFLASH_PEER_PYTHON, else None (no guessing)."""
    return flag or os.environ.get(PEER_PYTHON_ENV) or None


def blas_binding(threads: int | None) -> dict:
    """The OpenBLAS binding this process's MLX computes on (or would), for a peer to load."""
    from dflash_local.accel import blas

    bundled = blas.mlx_bundled_blas()
    library = blas.loaded_library() or (blas.fast_blas_library() if bundled else None)
    return {"library": str(library) if library else None,
            "bundled": bundled.name if bundled else None,
            "threads": threads or blas.blas_threads()}


def peer_cache_dir() -> Path:
    """Where peers keep what they calibrate (mlx-dspark), beside our own calibrations."""
    from dflash_local.paths import data_dir

    return data_dir() / "calibration" / "peers"


class PeerProcess:
    """One peer process: `request` sends a line and returns the reply, logging status lines."""

    def __init__(self, python: str, log: Callable[[str], None]):
        if not Path(python).is_file():
            raise PeerProcessError(f"the peer Python {python} does not exist (--peer-python / "
                                   f"{PEER_PYTHON_ENV}; scripts/setup_peers.sh makes one)")
        self.log = log
        self.blas: dict = {}  # the binding the process reports it computes on
        self.name = ""  # the peer row it runs, once loaded (row_name): what its log lines name
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the process; close() closes it
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            filter(None, [package_root, os.environ.get("PYTHONPATH")])))
        env.pop("LD_PRELOAD", None)  # the binding is loaded privately, as in our process
        self.process = subprocess.Popen(
            [python, "-m", "dflash_local.bench.peer_driver"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=env)

    def request(self, op: str, **fields) -> dict:
        try:
            self.process.stdin.write(json.dumps({"op": op, **fields}) + "\n")
            self.process.stdin.flush()
        except OSError:
            raise PeerProcessError(self._died(op)) from None
        for line in self.process.stdout:
            try:
                reply = json.loads(line)
            except ValueError:  # stray output on the protocol's pipe: said, not parsed
                self.log(f"peer output: {line.rstrip()[:200]}")
                continue
            if "status" in reply:
                self.log(reply["status"])
                continue
            if not reply.get("ok"):
                raise PeerProcessError(reply.get("error", "no reason given"))
            return reply
        raise PeerProcessError(self._died(op))

    def _died(self, op: str) -> str:
        code = self.process.wait()
        self.stderr.seek(0)
        tail = self.stderr.read().decode(errors="replace")[-STDERR_TAIL:].strip()
        return f"the peer process exited ({code}) during {op}: {tail or 'no output'}"

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()  # EOF ends the driver
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.stderr.close()


def start_peer(python: str, peer: str, drafter_dtype: str, target: str, drafter: str,
               blas: dict, log: Callable[[str], None]) -> tuple[PeerProcess, dict]:
    """A peer process with its peer loaded; (process, the load reply). Closes it on failure."""
    process = PeerProcess(python, log)
    try:
        process.blas = process.request("hello", blas=blas)["blas"]
        loaded = process.request("load", peer=peer, target=target, drafter=drafter,
                                 drafter_dtype=drafter_dtype, cache_dir=str(peer_cache_dir()))
        process.name = row_name(peer, loaded.get("version"), drafter_dtype)
    except BaseException:
        process.close()
        raise
    return process, loaded


def generate(process: PeerProcess, prompt_ids: list[int], params: GenerationParams) -> RunFigures:
    if not params.greedy:
        raise PeerProcessError("the Mac peers are measured greedy only (--temperature 0)")
    reply = process.request("generate", prompt_ids=list(prompt_ids), max_tokens=params.max_tokens,
                            block_size=None, seed=params.seed)
    ids = [int(token) for token in reply["token_ids"]]
    if reply.get("tokens_past_max"):
        process.log(f"{process.name or 'peer'} returned {reply['tokens_past_max']} tokens past "
                    f"max_tokens {params.max_tokens}: cut off")
    return RunFigures(prompt_tokens=reply["prompt_tokens"], completion_tokens=len(ids),
                      prefill_s=reply["prefill_s"], decode_s=reply["decode_s"],
                      committed_per_round=list(reply["committed_per_round"]), token_ids=ids)


def row_name(peer: str, version: str | None, drafter_dtype: str) -> str:
    return f"{peer} {version or ''}, {DRAFTER_DTYPES[drafter_dtype]}".replace(" ,", ",")

