"""Render the benchmark records (docs/records/*.json) into docs/benchmarks.md, and into the blocks
of README.md and models/README.md marked `<!-- benchmark:NAME -->` ... `<!-- /benchmark -->`.

A record is one benchmark run: title, what was measured, the command that made it, the day, the
machine, engine, dataset, settings, and its rows of figures. The prose never holds a figure the
records do not, so it cannot drift from them. The page shows the current tables (CURRENT, in that
order) in full; every other record is a development comparison, listed in an index by what it
`compares` (a field those records must have), sorted by name. Notes render on the page; a
record's `analysis` stays in the record.

    .venv/bin/python scripts/render_benchmarks.py          # rewrite the files
    .venv/bin/python scripts/render_benchmarks.py --check  # exit 1 when a file is out of date
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORDS_DIR = Path("docs/records")
BENCHMARKS_MD = Path("docs/benchmarks.md")
BLOCK_FILES = (Path("README.md"), Path("models/README.md"))
BLOCK = re.compile(r"(<!-- benchmark:(?P<name>[\w.-]+) -->\n).*?(<!-- /benchmark -->)", re.DOTALL)
REQUIRED = ("title", "measured", "command", "date", "machine", "engine", "dataset", "settings",
            "row_header", "columns", "rows", "source")
# The newest record of each kind for the shipped pair, in the order a reader asks: per engine on
# held-out prompts, chat, against the Mac peers, multi-turn, the prefix cache's disk tier, structured
# output, many clients at once
CURRENT = ("held-out-30-prompts", "chat-set-four-tries", "mac-peers-shipped", "prefix-cache-multiturn",
           "prefix-cache-memory", "prefix-disk-ttft", "prefix-disk-budget", "json-extraction",
           "concurrency-transformers-128", "concurrency-mlx-128")


def load_records(root: Path = ROOT) -> dict[str, dict]:
    """name (the file's stem) -> record, checked for the fields the renderer needs."""
    records = {}
    for path in sorted((root / RECORDS_DIR).glob("*.json")):
        record = json.loads(path.read_text(encoding="utf-8"))
        missing = [field for field in REQUIRED if field not in record]
        if missing:
            raise ValueError(f"{path.name}: missing fields {', '.join(missing)}")
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", record["date"]):
            raise ValueError(f"{path.name}: date {record['date']!r} is not YYYY-MM-DD")
        records[path.stem] = record
    return records


def number(value: float, decimals: int) -> str:
    """At least `decimals` places, more when the record holds more (1.375 stays 1.375)."""
    text = f"{value:.{decimals}f}"
    return text if float(text) == value else repr(value)


def cell_text(cell, column: dict) -> str:
    if cell is None:
        return ""
    if isinstance(cell, str):
        return cell
    if isinstance(cell, int | float):
        return number(cell, column.get("decimals", 2))
    if isinstance(cell, dict) and "speedup" in cell:
        text = f"{number(cell['speedup'], 2)}×"
        return text + (f" (τ {number(cell['tau'], 2)})" if cell.get("tau") is not None else "")
    raise ValueError(f"column {column['key']!r}: cannot render cell {cell!r}")


def table(record: dict) -> str:
    columns = record["columns"]
    lines = ["| " + " | ".join([record["row_header"], *(c["label"] for c in columns)]) + " |",
             "|" + "---|" * (len(columns) + 1)]
    for row in record["rows"]:
        bold = bool(row.get("bold"))
        cells = [f"**{row['label']}**" if bold else row["label"]]
        for column in columns:
            cell, text = row.get(column["key"]), cell_text(row.get(column["key"]), column)
            # a highlighted row's speedups stand out, not its plain figures
            cells.append(f"**{text}**" if bold and isinstance(cell, dict) else text)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def commands(record: dict) -> list[str]:
    command = record["command"]
    return [command] if isinstance(command, str) else list(command)


def command_lines(record: dict) -> str:
    listed = commands(record)
    if len(listed) == 1:
        return f"Command: `{listed[0]}`"
    return "Commands:\n" + "\n".join(f"- `{command}`" for command in listed)


def settings_text(settings: dict) -> str:
    return "; ".join(f"{key.replace('_', ' ')} {value}" for key, value in settings.items())


def record_section(name: str, record: dict) -> str:
    facts = (f"Date: {record['date']}. Machine: {record['machine']}. Engine: {record['engine']}. "
             f"Dataset: {record['dataset']}. Settings: {settings_text(record['settings'])}.")
    parts = [f"## {record['title']}", record["measured"], table(record), command_lines(record),
             facts]
    parts += record.get("notes", [])
    parts.append(f"Record: [`records/{name}.json`](records/{name}.json).")
    return "\n\n".join(parts)


HOW_TO_RUN = """## Running the peers and served engines

`dflash-local bench --peers` times, beside plain decoding and DFlash, the engine's in-process \
peers (Transformers generate, prompt lookup, assisted generation; mlx-lm generate and its draft \
model) and the Mac peers dflash-mlx 0.1.8 and mlx-dspark 0.20.3. The Mac peers live in a venv of \
their own and the bench finds it by a setting, never by guessing:

```bash
scripts/setup_peers.sh                 # makes .venv-peers: dflash-mlx, mlx-dspark, our mlx version
dflash-local bench --engine mlx --peers --peer-python .venv-peers/bin/python
export DFLASH_PEER_PYTHON=$PWD/.venv-peers/bin/python   # the same, for every run
dflash-local bench --peers --mac-peers dflash-mlx       # one of the two
dflash-local bench --peers --mac-peers ""               # none: the in-process peers only
```

Without the setting their rows say which to set. Every row of a Mac peer is a process of its own \
(`dflash_local/bench/peer_driver.py`, run by the peer venv's Python, JSON over stdin/stdout): it \
first loads the OpenBLAS binding the bench computes on, at the bench's thread count, before mlx is \
imported, then runs the peer through its own Python API on our prompt token ids, greedy: once with \
its own defaults (dflash-mlx: its offline runtime defaults, the drafter in its stored dtype; \
mlx-dspark: the drafter quantized to 4 bits, its kernels and its calibrated cap) and once with the \
drafter in float32. τ is the tokens each round committed as the peer reports them. A peer's \
reply keeps the first max-tokens tokens, the count plain decoding stops at: mlx-dspark 0.20.3's \
drafter rounds commit their whole accepted block even past `max_new_tokens` (its loop checks the \
budget only before a round; its lookup rounds are clamped to it, its drafter rounds are not), so \
it returns up to its cap more; the driver cuts them off, with their share of the rounds, and logs \
how many. mlx-dspark \
calibrates on its first use of a pair (about 11 minutes on a 2-core machine; the bench says \
"calibrating (first use)") and caches it under `calibration/peers/` in dflash-local's data dir.

The one shim: dflash-mlx's target backend takes only a `model_type` containing "qwen", and the \
embedded target is a Llama. `DflashMlx.__init__` in `dflash_local/bench/peer_backends.py` lifts \
that one check with one line, `QwenGdnTargetOps.supports_model = \
QwenGdnTargetOps._has_qwen_text_shape` (the Qwen text-shape check behind it stays); nothing else \
of either peer is changed. dflash-mlx 0.1.8 loads DFlash v1 drafters only: with a DFlash 2 drafter \
its rows carry its refusal (the drafter's convolution and selector weights); mlx-dspark loads both.

Served engines: `dflash-local bench --engine openai --base-url URL` measures a running \
OpenAI-compatible server (`dflash-local serve`, vLLM, SGLang) on the same datasets over HTTP; the \
server applies the chat template, and acceptance is the server's own: our service's per-round \
`dflash` statistics, vLLM's and SGLang's metrics around each request (SGLang's per-request details \
where it sends them). vLLM and SGLang speculate on every request, so plain decoding needs a plain \
server of the same target: `--plain-base-url URL`, or `--engine vllm|sglang`, which starts the \
server and a plain twin. Block sizes per request only on our service; `--lookup` and `--tree` are \
the server's own settings there."""


def development_index(records: dict[str, dict]) -> str:
    """One line per record that is not a current table: its file and what it compares."""
    lines = []
    for name, record in sorted(records.items()):
        if name in CURRENT:
            continue
        if not record.get("compares"):
            raise ValueError(f"{name}.json: a record outside CURRENT needs a 'compares' line")
        lines.append(f"- [`records/{name}.json`](records/{name}.json): {record['compares']}")
    return ("## Development records\n\n"
            "Comparisons made while building the method (A/B of code, loop variants, drafters, "
            "earlier drafters): kept as records, not rendered.\n\n" + "\n".join(lines))


def render_benchmarks(records: dict[str, dict]) -> str:
    missing = [name for name in CURRENT if name not in records]
    if missing:
        raise ValueError(f"CURRENT names records that {RECORDS_DIR} lacks: {', '.join(missing)}")
    head = ("# Benchmarks\n\n"
            "Rendered by `scripts/render_benchmarks.py` from the records in "
            "[`records/`](records/): edit a record and rerun the script, not this page. "
            "The current tables of the shipped pair; the other records are listed at the end. "
            "Every figure was measured on a shared virtual machine whose speed drifts between "
            "runs: compare figures within one table.\n\n"
            "How to read them: speedup is decode tokens per second over plain decoding's in the "
            "same run; τ is the mean number of tokens each round commits (accepted drafts plus "
            "the target's own token).")
    sections = [record_section(name, records[name]) for name in CURRENT]
    return "\n\n".join([head, *sections, HOW_TO_RUN, development_index(records)]) + "\n"


def render_block(name: str, records: dict[str, dict]) -> str:
    if name not in records:
        raise ValueError(f"no record {name!r} in {RECORDS_DIR} (markers name a record's file stem)")
    record = records[name]
    parts = [table(record), command_lines(record), *record.get("notes", []),
             f"Measured {record['date']} on a {record['machine']} ([details](docs/benchmarks.md))."]
    return "\n\n".join(parts) + "\n"


def rewrite_blocks(text: str, records: dict[str, dict], link_prefix: str = "") -> str:
    def replace(match: re.Match) -> str:
        block = render_block(match["name"], records)
        block = block.replace("](docs/", f"]({link_prefix}docs/")
        return f"{match.group(1)}{block}{match.group(3)}"

    return BLOCK.sub(replace, text)


def rendered_files(root: Path = ROOT) -> dict[Path, str]:
    """Every file the renderer owns (whole or in part) -> its content as rendered now."""
    records = load_records(root)
    files = {BENCHMARKS_MD: render_benchmarks(records)}
    for path in BLOCK_FILES:
        if (root / path).exists():
            prefix = "../" * (len(path.parts) - 1)
            files[path] = rewrite_blocks((root / path).read_text(encoding="utf-8"), records, prefix)
    return files


def stale_files(root: Path = ROOT) -> list[Path]:
    """The files whose content differs from what rendering would write (empty: all current)."""
    stale = []
    for path, content in rendered_files(root).items():
        current = root / path
        if not current.exists() or current.read_text(encoding="utf-8") != content:
            stale.append(path)
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 when a rendered file is out of date")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for path in stale:
            print(f"{path} is out of date: run scripts/render_benchmarks.py", file=sys.stderr)
        return 1 if stale else 0
    for path, content in rendered_files().items():
        (ROOT / path).write_text(content, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
