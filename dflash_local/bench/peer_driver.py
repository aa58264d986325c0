"""A peer's own process: `python -m dflash_local.bench.peer_driver`, run by a peer environment's
Python (scripts/setup_peers.sh), driven by the bench over stdin/stdout (peer_process.py).

Protocol: one JSON object a line. Requests carry "op":
  hello     {blas: {library, bundled, threads}}: load our OpenBLAS binding before mlx is imported
            (the library the bench's own process computes on, at its thread count); replies
            {python, packages, blas: {library, threads, gflops}}
  load      {peer, target, drafter, drafter_dtype ("default" | "float32"), cache_dir}: replies
            {name, version, settings}
  generate  {prompt_ids, max_tokens, block_size (null: the peer's own), seed}: replies
            {token_ids, prompt_tokens, prefill_s, decode_s, committed_per_round,
            tokens_past_max}: at most max_tokens ids; tokens_past_max, how many more the peer
            returned (cut off, with the rounds that made them)
Every reply has "ok"; a failure is {"ok": false, "error": "..."}. Before a reply the driver may
send {"status": "..."} lines (mlx-dspark calibrating on first use). Anything a peer library prints
goes to stderr: stdout carries the protocol only. EOF on stdin ends the process.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

PEER_PACKAGES = ("dflash-mlx", "mlx-dspark", "mlx", "mlx-lm")


class PeerDriverError(Exception):
    """A request the driver cannot serve; its message goes back as the reply's error."""


class Driver:
    def __init__(self, send):
        self.send = send
        self.backend = None
        self.greeted = False

    def handle(self, request: dict) -> dict:
        op = request.get("op")
        if op == "hello":
            return self.hello(request.get("blas") or {})
        if not self.greeted:
            raise PeerDriverError(f"{op!r} before hello: the BLAS binding must come first")
        if op == "load":
            return self.load(request)
        if op == "generate":
            if self.backend is None:
                raise PeerDriverError("generate before load")
            return self.backend.generate(request)
        raise PeerDriverError(f"unknown op {op!r} (known: hello, load, generate)")

    def hello(self, blas_request: dict) -> dict:
        from dflash_local.accel import blas

        if "mlx.core" in sys.modules:
            raise PeerDriverError("mlx was imported before hello: the BLAS binding cannot take")
        library = blas_request.get("library")
        if library:
            bundled = blas.mlx_bundled_blas()
            if bundled is None or bundled.name != blas_request.get("bundled"):
                raise PeerDriverError(
                    f"this environment's mlx bundles BLAS {bundled.name if bundled else None!r}, "
                    f"the bench's {blas_request.get('bundled')!r}: the OpenBLAS binding would not "
                    f"take (install the bench's mlx[cpu] version here)")
            if blas.preload_library(Path(library), blas_request.get("threads")) is None:
                raise PeerDriverError(f"could not load the OpenBLAS {library}")
        self.greeted = True
        status = blas.blas_status(warn=False) if _has("mlx") else None
        return {"python": sys.executable, "packages": {name: _version(name) for name in PEER_PACKAGES},
                "blas": {"library": str(blas.loaded_library() or ""), "threads": blas.blas_threads(),
                         "gflops": round(status.gflops, 1) if status else None}}

    def load(self, request: dict) -> dict:
        from dflash_local.bench import peer_backends

        peer = request.get("peer")
        if peer not in peer_backends.BACKENDS:
            raise PeerDriverError(f"unknown peer {peer!r} (known: {', '.join(peer_backends.BACKENDS)})")
        package = peer_backends.BACKENDS[peer].package
        if _version(package) is None:
            raise PeerDriverError(f"{package} is not installed for {sys.executable} "
                                  f"(scripts/setup_peers.sh installs it)")
        dtype = request.get("drafter_dtype", "default")
        if dtype not in ("default", "float32"):
            raise PeerDriverError(f"drafter_dtype must be 'default' or 'float32', got {dtype!r}")
        self.backend = peer_backends.BACKENDS[peer](
            Path(request["target"]), Path(request["drafter"]), dtype,
            Path(request["cache_dir"]), status=lambda text: self.send({"status": text}))
        return {"name": peer, "version": _version(package), "settings": self.backend.settings}


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def main() -> int:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the peers' own prints (progress, calibration) go to stderr

    def send(message: dict) -> None:
        protocol.write(json.dumps(message) + "\n")
        protocol.flush()

    driver = Driver(send)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply = {"ok": True, **driver.handle(json.loads(line))}
        except PeerDriverError as exc:
            reply = {"ok": False, "error": str(exc)}
        except Exception as exc:  # noqa: BLE001 - a peer's own failure (it refused our pair): the row says it
            traceback.print_exc()
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:1500]}
        send(reply)
    return 0


if __name__ == "__main__":
    sys.exit(main())
