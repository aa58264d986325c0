"""The vLLM engine: `vllm serve` as a child process with DFlash's speculative config.

The flags are server_flags.py's (read from vLLM's own source); the process is launch.py's; the
streaming and the statistics (Prometheus spec-decode counters) are openai_engine.py's.
"""

from __future__ import annotations

from dflash_local.engines import server_flags
from dflash_local.engines.launch import LaunchedEngine
from dflash_local.engines.server_flags import LaunchSpec
from dflash_local.engines.table import VLLM


class VLLMEngine(LaunchedEngine):
    server = VLLM.name
    health_path = "/health"

    def build_args(self, spec: LaunchSpec, version: str,
                   distribution: str) -> tuple[list[str], dict[str, str]]:
        return server_flags.vllm_args(spec, version, distribution)
