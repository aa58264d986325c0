"""Claude Code itself (from npm) through `dflash-local launch --server` against the real service:
its default tools and prompt, one streamed turn in which the tiny target calls Claude Code's Read
tool, Claude Code runs it and sends the result back, and the target answers; speculative output
equal to plain. About 30-60 s on two cores (the target is trained on the recorded prompt).

Runs where `claude` is installed: on PATH, or in DFLASH_AGENT_CLIENTS_NPM's node_modules/.bin
(scripts/run-tests.sh installs it unless DFLASH_CI_AGENTS=0). Codex and opencode, a few minutes
more: scripts/agent_clients.py.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def claude_bin_dir() -> Path | None:
    npm = os.environ.get("DFLASH_AGENT_CLIENTS_NPM")
    if npm and (Path(npm) / "node_modules" / ".bin" / "claude").exists():
        return Path(npm) / "node_modules" / ".bin"
    found = shutil.which("claude")
    return Path(found).parent if found else None


def agent_clients_script():
    spec = importlib.util.spec_from_file_location("agent_clients", REPO / "scripts" / "agent_clients.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.skipif(claude_bin_dir() is None, reason="Claude Code is not installed (npm install "
                    "@anthropic-ai/claude-code; scripts/run-tests.sh installs it)")
def test_claude_code_runs_its_own_tool_and_gets_the_answer(tmp_path):
    script = agent_clients_script()
    report = script.one_client("claude", claude_bin_dir(), tmp_path)
    assert report["record"]["exit"] == 0 and report["run"]["exit"] == 0, report
    assert report["result_sent_back"], report  # Claude Code ran Read and sent its result
    assert report["answered"], report["run_replies"]  # the call, then the answer after the result
    assert report["speculative_equals_plain"]
