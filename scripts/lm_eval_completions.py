"""lm-eval's loglikelihood over POST /v1/completions equals the target's own forward.

Serves the embedded pair (`dflash-local serve`, speculative), runs lm-eval's `local-completions`
model from its own venv on a small multiple-choice task written here as local JSONL (offline:
nothing is downloaded), then scores every request lm-eval made with one forward of the
Transformers model over the same tokens, split into context and continuation as lm-eval splits
them, and compares each loglikelihood and is_greedy, and the task's accuracy.

    python scripts/lm_eval_completions.py --lm-eval /tmp/completions/venv/bin/lm_eval \
        [--engine transformers|mlx] [--record docs/records/lm-eval-completions.json]

The lm-eval venv needs `lm-eval[api]` and `transformers` (its tokenizer; no torch):
`python3 -m venv /tmp/completions/venv && /tmp/completions/venv/bin/pip install 'lm-eval[api]'
transformers`. Prints one
JSON summary; exit 1 when a loglikelihood differs past TOLERANCE or an is_greedy disagrees.
"""

from __future__ import annotations

import argparse
import ast
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
SERVING = re.compile(r"serving .* on (http://\S+)")
TASK = "dflash_completions_mc"
# float32 logits summed in another order (a chunked prefill, a speculative verify): well below
# the gap between two answers' loglikelihoods
TOLERANCE = 1e-3
QUESTIONS = [
    ("The capital of France is", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("Water freezes at a temperature of zero degrees", ["Celsius", "Kelvin", "miles", "hours"], 0),
    ("The opposite of hot is", ["cold", "green", "loud", "square"], 0),
    ("A week has seven", ["days", "apples", "rivers", "songs"], 0),
    ("The sun rises in the", ["east", "basement", "ocean", "drawer"], 0),
    ("Cats often chase", ["mice", "planets", "taxes", "clouds"], 0),
    ("To write a letter you need a", ["pen", "volcano", "whale", "bridge"], 0),
    ("The largest ocean on Earth is the", ["Pacific", "Sahara", "Alps", "Amazon"], 0),
    ("Two plus two equals", ["four", "seven", "purple", "Tuesday"], 0),
    ("Bees make", ["honey", "steel", "glass", "paper"], 0),
    ("In winter it often", ["snows", "sings", "melts", "swims"], 0),
    ("A doctor works in a", ["hospital", "volcano", "submarine", "desert"], 0),
]
TASK_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lm-eval", default="/tmp/completions/venv/bin/lm_eval",
                        help="the lm_eval command of a venv with lm-eval[api] and transformers")
    parser.add_argument("--engine", default="transformers", choices=["transformers", "mlx"])
    parser.add_argument("--record", type=Path, help="write the result as this JSON record")
    args = parser.parse_args()
    from dflash_local.pairs.embedded import import_embedded

    target = import_embedded()
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        task_dir = write_task(work)
        started = time.monotonic()
        samples, accuracy, served_name = run_lm_eval(args, target, task_dir, work)
        eval_s = time.monotonic() - started
    compared = compare(samples, target)
    summary = {"served": served_name, "engine": args.engine, "requests": len(compared),
               "lm_eval_acc": accuracy, "forward_acc": forward_accuracy(samples, compared),
               "max_abs_difference": max(abs(row["difference"]) for row in compared),
               "greedy_agree": all(row["greedy_agree"] for row in compared),
               "lm_eval_s": round(eval_s, 1)}
    print(json.dumps(summary, indent=1))
    if args.record is not None:
        from dflash_local.bench.report import write_record

        write_record(args.record, record(summary, compared))
    return 0 if summary["max_abs_difference"] <= TOLERANCE and summary["greedy_agree"] else 1


def write_task(work: Path) -> Path:
    data = work / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                            for q, c, a in QUESTIONS))
    task_dir = work / "tasks"
    task_dir.mkdir()
    (task_dir / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=data))
    return task_dir


def run_lm_eval(args, target: Path, task_dir: Path, work: Path) -> tuple[list[dict], float, str]:
    """lm-eval against a served embedded pair: its logged samples, its accuracy, the served name."""
    serve = subprocess.Popen(
        [sys.executable, "-m", "dflash_local.cli.main", "serve", "--port", "0", "--engine",
         args.engine], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        url = next((match.group(1) for line in serve.stdout if (match := SERVING.search(line))), None)
        if url is None:
            raise SystemExit("dflash-local serve did not start")
        served_name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        model_args = (f"model={served_name},base_url={url}/v1/completions,tokenizer_backend="
                      f"huggingface,tokenizer={target},num_concurrent=1,max_retries=1")
        out = work / "out"
        offline = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        subprocess.run([args.lm_eval, "--model", "local-completions", "--model_args", model_args,
                        "--tasks", TASK, "--include_path", str(task_dir), "--log_samples",
                        "--output_path", str(out)], check=True, env=offline)
    finally:
        serve.terminate()
        serve.wait(60)
    samples_file = next(out.rglob(f"samples_{TASK}_*.jsonl"))
    results_file = next(out.rglob("results_*.json"))
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    accuracy = json.loads(results_file.read_text())["results"][TASK]["acc,none"]
    return samples, accuracy, served_name


def lm_eval_split(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The ids lm-eval sends for (context, continuation): the context's trailing spaces moved to
    the continuation, the whole encoded once and split at the context's own length."""
    stripped = context.rstrip()
    continuation = context[len(stripped):] + continuation
    whole = tokenizer(stripped + continuation, add_special_tokens=False).input_ids
    context_ids = tokenizer(stripped, add_special_tokens=False).input_ids
    return context_ids, whole[len(context_ids):]


def compare(samples: list[dict], target: Path) -> list[dict]:
    """Each request's loglikelihood and is_greedy, from lm-eval and from the model's forward."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    rows = []
    for sample in samples:
        for arguments, response in zip(sample["arguments"].values(), sample["resps"], strict=True):
            context_ids, continuation_ids = lm_eval_split(tokenizer, arguments["arg_0"],
                                                          arguments["arg_1"])
            ids = context_ids + continuation_ids
            with torch.inference_mode():
                logits = model(torch.tensor([ids])).logits[0].double()
            predicting = torch.log_softmax(logits[len(context_ids) - 1 : -1], dim=-1)
            targets = torch.tensor(continuation_ids)
            loglikelihood = predicting[torch.arange(len(targets)), targets].sum().item()
            greedy = bool((predicting.argmax(-1) == targets).all())
            served_ll, served_greedy = logged_result(response)
            rows.append({"doc": sample["doc_id"], "continuation": arguments["arg_1"],
                         "lm_eval": served_ll, "forward": loglikelihood,
                         "difference": served_ll - loglikelihood,
                         "greedy_agree": bool(served_greedy) == greedy})
    return rows


def logged_result(response: list) -> tuple[float, bool]:
    """A request's (loglikelihood, is_greedy) as lm-eval logs it: values, or their text."""
    value = response[0]
    if isinstance(value, str):
        value = ast.literal_eval(value)
    loglikelihood, greedy = value
    return float(loglikelihood), greedy in (True, "True")


def forward_accuracy(samples: list[dict], compared: list[dict]) -> float:
    """The task's accuracy had the forward's loglikelihoods been lm-eval's."""
    right = 0
    for sample in samples:
        choices = [row["forward"] for row in compared if row["doc"] == sample["doc_id"]]
        right += max(range(len(choices)), key=choices.__getitem__) == sample["doc"]["answer"]
    return right / len(samples)


def record(summary: dict, compared: list[dict]) -> dict:
    return {
        "title": "lm-eval loglikelihood over /v1/completions against the target's own forward",
        "compares": "lm-eval's local-completions loglikelihoods through /v1/completions (echo + "
                    "prompt logprobs) against a direct Transformers forward, per request",
        "measured": f"lm-eval local-completions on a {len(QUESTIONS)}-question multiple-choice "
                    f"task (local JSONL, {summary['requests']} loglikelihood requests) against "
                    f"`dflash-local serve --engine {summary['engine']}` on the embedded pair "
                    "(speculative); each request's loglikelihood recomputed from one float32 "
                    "Transformers forward over the same tokens.",
        "command": f"python scripts/lm_eval_completions.py --engine {summary['engine']} "
                   "--record docs/records/lm-eval-completions.json",
        "date": time.strftime("%Y-%m-%d"),
        "engine": summary["engine"], "dataset": f"{len(QUESTIONS)} questions, 4 choices each "
                                                "(scripts/lm_eval_completions.py)",
        "settings": {"lm_eval": "local-completions, tokenized requests, batch 1",
                     "tolerance": TOLERANCE},
        "row_header": "measure",
        "columns": [{"key": "value", "label": "value"}],
        "rows": [{"label": "loglikelihood requests", "value": summary["requests"]},
                 {"label": "largest |lm-eval - forward|", "value": f"{summary['max_abs_difference']:.2e}"},
                 {"label": "is_greedy agrees on every request", "value": str(summary["greedy_agree"])},
                 {"label": "acc (lm-eval)", "value": summary["lm_eval_acc"]},
                 {"label": "acc (forward)", "value": summary["forward_acc"]}],
        "source": "scripts/lm_eval_completions.py",
    }


if __name__ == "__main__":
    sys.exit(main())
