"""What a benchmark leaves behind: the JSON record, a PNG plot, and the table on the terminal; and
for the scripts that measure one thing, a docs/records/ record with its machine named."""

from __future__ import annotations

import json
import re
from pathlib import Path

from dflash_local.bench.machine import describe
from dflash_local.bench.noise import NOISY_STEAL_SHARE
from dflash_local.method.calibration_noise import BUSY_SHARE
from dflash_local.method.planning.modes import FALLBACK, LOOKUP, PROBE

NOISY_LOAD_PER_CORE = 0.5  # a 1-minute load average this far per core above the run's own threads: suspect


def write_outputs(record: dict, out_dir: Path) -> tuple[Path, Path | None]:
    """record -> out_dir/<stem>.json and <stem>.png; the PNG is None without matplotlib."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = re.sub(r"[^0-9T]", "", record["created"])[:15]
    stem = f"bench-{record['engine']}-{'-'.join(record['datasets'])}-{stamp}"
    json_path = out_dir / f"{stem}.json"
    json_path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    png_path = out_dir / f"{stem}.png"
    return json_path, png_path if plot(record, png_path) else None


def write_record(path: Path, record: dict, *, threads: int | None = None, setting: str = "",
                 machine: dict | None = None) -> dict:
    """A docs/records/ record to `path` with its machine named by bench/machine.describe():
    "machine" the line the benchmarks page prints (`setting` says what else ran, as "a virtual
    machine"), "machine_details" the whole description (`machine`: one the run took itself,
    else described now). Returns the record as written."""
    machine = machine or describe(threads)
    load = machine.get("load_average")
    words = [machine_words(machine), *([setting] if setting else []),
             *([f"load {load:.1f}"] if load is not None else [])]
    written = {**record, "machine": f"{machine['cpu_model']} ({'; '.join(words)})",
               "machine_details": machine}
    path.write_text(json.dumps(written, indent=1, ensure_ascii=False) + "\n")
    return written


def format_table(record: dict) -> str:
    header = f"{'dataset':<12} {'method':<34} {'tok/s':>8} {'speedup':>8} {'τ':>6} " \
             f"{'prefill':>9}  note"
    lines = [_title(record), header, "-" * len(header)]
    for dataset, result in record["datasets"].items():
        plain = result["methods"].get("plain", {})
        for method, summary in result["methods"].items():
            lines.append(_row(dataset, method, summary, _note(method, summary, result)))
        for peer, reason in result.get("unavailable", {}).items():
            lines.append(f"{dataset:<12} {peer:<34} {'-':>8} {'-':>8} {'-':>6} {'-':>9}  {reason}")
        for method, summary in result["methods"].items():
            if "acceptance_histogram" in summary:  # ours and any peer that reports rounds
                lines.append(f"{'':<12} {method} committed/round 1..B: "
                             f"{summary['acceptance_histogram']}")
        if not plain:
            lines.append(f"{dataset:<12} (no plain runs)")
    lines.extend(_noise_warnings(record))
    return "\n".join(lines)


def _title(record: dict) -> str:
    machine = record["machine"]
    repeats = record["settings"].get("repeats", 1)
    return (f"{record['engine']} · {record['target']} + {record['drafter']} · {record['dtype']} · "
            f"{machine['cpu_model']} ({machine_words(machine)}) · max_tokens "
            f"{record['settings']['max_tokens']} · T={record['settings']['temperature']}"
            + (f" · fastest of {repeats} tries" if repeats > 1 else ""))


def machine_words(machine: dict) -> str:
    """Cores, the widest vector extension, the BLAS kernels: what explains a day's difference
    (records from before bench/machine.py name the cores alone)."""
    words = [f"{machine['cores']} cores"]
    flags = [flag for flag in ("avx512f", "avx2", "asimd") if flag in machine.get("cpu_flags", ())]
    words += flags[:1]
    words += [f"{blas['library'].split('.so')[0]} {blas['kernel']}" for blas in machine.get("blas", ())
              if blas.get("kernel")]
    if machine.get("torch"):
        words.append(f"torch {machine['torch']['cpu_capability']}")
    return ", ".join(words)


def _row(dataset: str, method: str, summary: dict, note: str) -> str:
    speedup = summary.get("speedup")
    tau = summary.get("tau")
    return (f"{dataset:<12} {method:<34} {summary['decode_tokens_per_s']:>8.1f} "
            f"{(f'{speedup:.2f}x' if speedup else '-'):>8} {(f'{tau:.2f}' if tau else '-'):>6} "
            f"{summary['prefill_tokens_per_s']:>9.0f}  {note}")


def _note(method: str, summary: dict, result: dict) -> str:
    notes = []
    if method != "plain":
        same = [s["identical_to_plain"].get(method) for s in result["samples"]]
        notes.append(f"identical {sum(bool(x) for x in same)}/{len(same)}")
    modes = summary.get("rounds_by_mode")
    if modes:
        rounds = sum(modes.values())
        fallback = modes.get(FALLBACK, 0) + modes.get(PROBE, 0)
        notes.append(f"mean width {summary['mean_width']:.1f}")
        if fallback:
            notes.append(f"fallback {100 * fallback / rounds:.0f}% of rounds")
        if modes.get(LOOKUP):
            notes.append(f"lookup {100 * modes[LOOKUP] / rounds:.0f}% of rounds")
    if summary.get("constraint_us_per_token"):
        notes.append(f"constraint {summary['constraint_us_per_token']:.0f} µs/token")
    return ", ".join(notes)


def _noise_warnings(record: dict) -> list[str]:
    warnings = []
    cores = record["machine"].get("cores") or 1
    own = record.get("threads") or 1  # the run's own compute threads count in the load average
    loads = [load[0] for result in record["datasets"].values()
             for load in result["load_average"].values() if load]
    if loads and max(loads) - own > NOISY_LOAD_PER_CORE * cores:
        warnings.append(f"warning: load average up to {max(loads):.1f} on {cores} cores during "
                        f"the run, which computes on {own} thread(s): other processes shared the "
                        "CPU, these timings are noisy")
    others = [result.get("others_cores") or 0.0 for result in record["datasets"].values()]
    if others and max(others) > BUSY_SHARE * cores:
        warnings.append(f"warning: other processes kept up to {max(others):.1f} of {cores} cores "
                        "busy during a dataset: its ratios are unreliable")
    steals = [result.get("cpu_steal_share") or 0.0 for result in record["datasets"].values()]
    if steals and max(steals) > NOISY_STEAL_SHARE:
        hint = "" if record["settings"].get("repeats", 1) > 1 else \
            "; --repeats N keeps each method's fastest of N tries"
        warnings.append(f"warning: the hypervisor took up to {100 * max(steals):.0f}% of the CPU "
                        f"time during a dataset (steal): timings are noisy{hint}")
    return warnings


def plot(record: dict, path: Path) -> bool:
    """Decode tok/s of every method and τ of the speculative ones, per dataset."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    datasets = list(record["datasets"])
    methods = list(dict.fromkeys(m for r in record["datasets"].values() for m in r["methods"]))
    figure, (speed_axes, tau_axes) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(len(methods), 1)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for offset, method in enumerate(methods):
        color = colors[offset % len(colors)]
        xs = [i + offset * width for i in range(len(datasets))]
        speeds = [record["datasets"][d]["methods"].get(method, {}).get("decode_tokens_per_s", 0)
                  for d in datasets]
        taus = [record["datasets"][d]["methods"].get(method, {}).get("tau") or 0 for d in datasets]
        speed_axes.bar(xs, speeds, width, label=method, color=color)
        if any(taus):
            tau_axes.bar(xs, taus, width, label=method, color=color)
    for axes, label in ((speed_axes, "decode tokens/s"), (tau_axes, "τ (tokens per round)")):
        axes.set_xticks([i + 0.4 - width / 2 for i in range(len(datasets))], datasets)
        axes.set_ylabel(label)
        axes.grid(axis="y", alpha=0.3)
    speed_axes.legend(fontsize="small")
    figure.suptitle(f"{record['engine']} · {Path(str(record['target'])).name} · "
                    f"{record['machine']['cpu_model']}", fontsize="medium")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True
