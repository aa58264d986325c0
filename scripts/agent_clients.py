"""Claude Code, Codex and opencode, installed from npm, each through `dflash-local launch
--server` against the real service on a tiny tool-calling target: one streamed turn in which the
model calls one of the client's own tools, the client runs it and sends the result back, and the
model answers. Speculative output is checked equal to plain on every prompt the client sent.

    scripts/agent_clients.py [--clients claude,codex,opencode] [--work DIR]

Per client, three passes through the real service (tests/agent_tiny.py's Hermes template):
1. record: the engine's stream is scripted (the call, then the answer, "OK" to side requests),
   so the client's own prompts (system prompt, default tools, its tool's result) are recorded;
2. train: a tokenizer with each recorded paragraph and line as one token (a 70k-character agent
   prompt becomes a few hundred tokens), and a tiny Qwen3 trained to write each scripted reply;
3. run: the trained target, speculative (block 8), answers the client for real.
Prints one JSON line per client: its passes' seconds, prompt sizes, the tool result sent back.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import string
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]
NPM_PACKAGES = ("@anthropic-ai/claude-code", "@openai/codex", "opencode-ai")
QUESTION = "What do the notes say? Read notes.txt."
NOTES = "the launch works"
ANSWER = "The notes say: the launch works."
SIDE_REPLY = "OK"
VARYING_RESULTS = ("codex",)  # its exec_command result holds a chunk id and the wall time
CLIENT_TIMEOUT_S = 600
MAX_POSITIONS = 262144  # the tiny targets' context: room for every client's max_tokens
RESULT = re.compile(r"(?<=<tool_response>\n).*?(?=\n</tool_response>)", re.DOTALL)


def tool_call(client: str, work: Path) -> tuple[str, dict]:
    """The client's own tool the model calls, with its arguments."""
    if client == "claude":
        return "Read", {"file_path": str(work / "notes.txt")}
    if client == "codex":
        return "exec_command", {"cmd": "cat notes.txt"}
    return "read", {"filePath": str(work / "notes.txt")}


def client_args(client: str) -> list[str]:
    if client == "claude":
        return ["-p", QUESTION, "--output-format", "stream-json", "--verbose"]
    if client == "codex":
        return ["exec", "--skip-git-repo-check", "--json", QUESTION]
    return ["run", "--format", "json", QUESTION]


def install(npm_dir: Path) -> Path:
    bin_dir = npm_dir / "node_modules" / ".bin"
    if not all((bin_dir / name).exists() for name in ("claude", "codex", "opencode")):
        subprocess.run(["npm", "install", "--prefix", str(npm_dir), *NPM_PACKAGES], check=True)
    return bin_dir


def scripted_reply(prompt_text: str, call_text: str) -> str:
    if "<tool_response>" in prompt_text:
        return ANSWER
    return call_text if QUESTION in prompt_text and "<tools>" in prompt_text else SIDE_REPLY


class Recorder:
    """Wraps the loaded engine's stream: records each prompt, and either scripts the reply
    (record pass) or lets the real engine answer (run pass), recording its tokens."""

    def __init__(self, engine, call_text: str | None):
        self.engine, self.call_text = engine, call_text
        self.real_stream = engine.stream
        self.prompts: list[list[int]] = []
        self.replies: list[list[int]] = []
        self.params: list = []  # each request's, its constraint included
        self.refused: list[str | None] = []  # the error a request ended with, if one did
        engine.stream = self.stream

    def stream(self, prompt_ids, params):
        from dflash_local.events import StepEvent

        self.prompts.append(list(prompt_ids))
        self.replies.append([])
        self.params.append(params)
        self.refused.append(None)
        if self.call_text is None:
            try:
                for event in self.real_stream(prompt_ids, params):
                    self.replies[-1].extend(event.token_ids)
                    yield event
            except Exception as exc:  # plain decoding must refuse it the same way
                self.refused[-1] = str(exc)
                raise
            return
        tokenizer = self.engine.tokenizer
        text = scripted_reply(tokenizer.decode(prompt_ids), self.call_text)
        ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        self.replies[-1] = ids
        yield StepEvent(token_ids=tuple(ids), text=text, prompt_tokens=len(prompt_ids),
                        finish_reason="stop", mode="plain")


def start(target: Path, drafter: Path, block_size, api_key: str):
    from service_support import torch_loader

    from dflash_local.service.app import create_app
    from dflash_local.service.server import BackgroundServer
    from dflash_local.service.state import ServiceState

    state = ServiceState(loader=torch_loader, api_key=api_key)
    state.load("transformers", target, drafter, served_name="tiny-agent", block_size=block_size)
    return state, BackgroundServer(create_app(state)).start()


def run_client(client: str, bin_dir: Path, url: str, api_key: str, work: Path, log: Path) -> dict:
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "DFLASH_LOCAL_API_KEY": api_key, "PYTHONPATH": str(REPO), "PWD": str(work),
           "HOME": str(work / "home"), "XDG_CONFIG_HOME": str(work / "home" / ".config")}
    command = [sys.executable, "-m", "dflash_local.cli.main", "launch", client, "--server", url,
               "--", *client_args(client)]
    started = time.perf_counter()
    with log.open("w") as out:
        done = subprocess.run(command, check=False, cwd=work, env=env, stdout=out,
                              stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, timeout=CLIENT_TIMEOUT_S)
    return {"exit": done.returncode, "seconds": round(time.perf_counter() - started, 1)}


def added_tokens(texts: list[str]) -> list[str]:
    """Each paragraph and each line of the recorded prompts, longest first (one token each)."""
    pieces = {piece for text in texts for part in text.split("\n\n")
              for piece in (part, *part.split("\n")) if len(piece) >= 8}
    return sorted(pieces, key=len, reverse=True)


def with_other_results(texts: list[str], replies: list[str], copies: int):
    """Each prompt with a tool result, again with that result's letters and digits changed at
    random: a result that differs from run to run (codex's chunk id and wall time) still gets
    the answer."""
    rng = random.Random(0)
    alphabet = string.ascii_letters + string.digits

    def noisy(match: re.Match) -> str:
        return "".join(rng.choice(alphabet) if char.isalnum() and rng.random() < 0.5 else char
                       for char in match.group(0))

    for text, reply in zip(texts, replies, strict=True):
        yield text, reply
        if copies and "<tool_response>" in text:
            yield from ((RESULT.sub(noisy, text), reply) for _ in range(copies))


def build_target(out: Path, texts: list[str], replies: list[str], varying: bool) -> Path:
    """agent_tiny's tokenizer plus the recorded pieces, and a tiny Qwen3 trained to write each
    reply after its prompt (the prompts as the service renders them: the recorded texts).
    `varying`: the client's tool results differ from run to run; the results stay out of the
    tokens, and the target learns to answer whatever the result says."""
    from agent_tiny import make_tokenizer, train_target
    from tokenizers import AddedToken

    tokenizer = make_tokenizer(out)
    tokenizer.add_tokens([AddedToken(piece, special=False, normalized=False)
                          for piece in added_tokens([RESULT.sub("", text) for text in texts])])
    tokenizer.save_pretrained(out)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    examples = [(tokenizer.encode(text, add_special_tokens=False),
                 tokenizer.encode(reply, add_special_tokens=False) + [end])
                for text, reply in with_other_results(texts, replies, 16 if varying else 0)]
    return train_target(out, tokenizer, examples, max_positions=MAX_POSITIONS,
                        loss_floor=0.002 if varying else 0.01)


def one_client(client: str, bin_dir: Path, root: Path) -> dict:
    import tiny_models
    from agent_tiny import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

    from dflash_local.events import parse_block_size

    work = root / client
    (work / "home").mkdir(parents=True, exist_ok=True)
    (work / "notes.txt").write_text(NOTES + "\n")
    # a project of its own: opencode asks before it reads outside its project (the directory
    # PWD names), and `opencode run` rejects whatever it would ask
    subprocess.run(["git", "init", "-q", str(work)], check=True)
    name, arguments = tool_call(client, work)
    call_text = TOOL_CALL_OPEN + json.dumps({"name": name, "arguments": arguments}) + TOOL_CALL_CLOSE
    report: dict = {"client": client, "tool": name}
    texts, replies = _record(client, bin_dir, root, work, call_text, report)
    started = time.perf_counter()
    target = build_target(root / f"{client}-target", texts, replies, client in VARYING_RESULTS)
    drafter = tiny_models.make_drafter(root / f"{client}-drafter", target, block_size=8)
    report["train_seconds"] = round(time.perf_counter() - started, 1)
    # the run: speculative (block 8) on the trained target
    state, server = start(target, drafter, parse_block_size(8), "k")
    engine = state.loaded.engine
    recorder = Recorder(engine, None)
    report["run"] = run_client(client, bin_dir, server.url, "k", work, root / f"{client}-run.log")
    state.loaded.worker.close()  # idle now: no turn warm-up beside the plain decodes below
    report["speculative_equals_plain"] = _lossless(recorder)
    server.stop()
    report["prompt_tokens"] = [len(ids) for ids in recorder.prompts]
    report["run_replies"] = [engine.tokenizer.decode(ids) for ids in recorder.replies]
    written = "".join(report["run_replies"])
    report["answered"] = call_text in written and ANSWER in written
    return report


def _record(client: str, bin_dir: Path, root: Path, work: Path, call_text: str,
            report: dict) -> tuple[list[str], list[str]]:
    """The client's prompts as the service renders them, and the scripted replies: an
    untrained target with the byte tokenizer, so text in and text out are exact."""
    import tiny_models
    from agent_tiny import AGENT_TEMPLATE, tiny_qwen3

    from dflash_local.events import parse_block_size

    blank = root / f"{client}-blank"
    tokenizer = tiny_models.make_tokenizer(blank)
    tokenizer.chat_template = AGENT_TEMPLATE
    tokenizer.save_pretrained(blank)
    tiny_qwen3(len(tokenizer), max_positions=MAX_POSITIONS).save_pretrained(blank)
    drafter = tiny_models.make_drafter(root / f"{client}-blank-drafter", blank, block_size=8)
    state, server = start(blank, drafter, parse_block_size(1), "k")
    recorder = Recorder(state.loaded.engine, call_text)
    report["record"] = run_client(client, bin_dir, server.url, "k", work, root / f"{client}-record.log")
    server.stop()
    texts = [tokenizer.decode(ids) for ids in recorder.prompts]
    (root / f"{client}-prompts.json").write_text(json.dumps(texts))
    report["requests"] = len(texts)
    report["prompt_chars"] = [len(text) for text in texts]
    report["result_sent_back"] = any("<tool_response>" in text for text in texts)
    return texts, [tokenizer.decode(ids[:-1]) for ids in recorder.replies]


def _lossless(recorder: Recorder) -> bool:
    """Each prompt the client sent, decoded plain with the request's own params (its constraint
    included): the tokens the speculative run wrote, or the same refusal."""

    for prompt, reply, asked, refused in zip(recorder.prompts, recorder.replies, recorder.params,
                                             recorder.refused, strict=True):
        params = replace(asked, max_tokens=max(len(reply), 1), speculative=False)
        try:
            plain = [token for event in recorder.real_stream(prompt, params)
                     for token in event.token_ids]
        except Exception as exc:  # noqa: BLE001 (the refusal the speculative run met, compared)
            if str(exc) != refused:
                return False
            continue
        if refused is not None or plain != reply:
            return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="claude,codex,opencode")
    parser.add_argument("--work", type=Path, default=Path("/tmp/agent-launch/run"))
    parser.add_argument("--npm", type=Path, default=Path("/tmp/agent-launch/npm"))
    args = parser.parse_args()
    bin_dir = install(args.npm)
    failed = 0
    for client in args.clients.split(","):
        started = time.perf_counter()
        report = one_client(client, bin_dir, args.work)
        report["seconds"] = round(time.perf_counter() - started, 1)
        print(json.dumps(report), flush=True)
        failed += not (report["answered"] and report["result_sent_back"]
                       and report["speculative_equals_plain"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
