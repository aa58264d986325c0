"""The SGLang engine: `python -m sglang.launch_server` as a child process with DFLASH flags.

The flags are server_flags.py's (read from SGLang's own source); the process is launch.py's; the
streaming and the statistics (`sglext.spec_tokens_details`, or its counters) are openai_engine.py's.
"""

from __future__ import annotations

from dflash_local.engines import server_flags
from dflash_local.engines.launch import LaunchedEngine
from dflash_local.engines.server_flags import LaunchSpec
from dflash_local.engines.table import SGLANG


class SGLangEngine(LaunchedEngine):
    server = SGLANG.name
    health_path = "/health"  # 503 while the server starts, 200 once it serves

    def build_args(self, spec: LaunchSpec, version: str,
                   distribution: str) -> tuple[list[str], dict[str, str]]:
        return server_flags.sglang_args(spec, version, distribution)
