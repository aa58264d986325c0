"""The model picker: the service's catalog with, per pair, size, whether it fits in memory, whether
it is downloaded, where it runs; download (progress, cancel) and load. A refusal shows the
service's own explanation (e.g. which compatibility check failed)."""

from __future__ import annotations

import asyncio
from typing import ClassVar

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.message import Message
from textual.screen import Screen
from textual.widgets import DataTable, Footer, ProgressBar, Static

from dflash_chat.protocol import PHASE_CALIBRATING, ServiceError

LOAD_POLL_S = 1.0  # how often a pending load asks the service what it is doing

COLUMNS = (("Pair", 22), ("Runs on", 26), ("Size", 9), ("Fits", 10), ("Downloaded", 10),
           ("Thinking", 8), ("Loaded", 6))
SIZE_NOTES = {"?": "size: not known until the files are listed (d downloads)",
              ">": "size: at least this (the target's alone; the drafter's is not known yet)"}

MIN_COLUMN = 5
PAIR_MIN = 18  # the pair's id is what a row is: its column gives up cells last


def fitted_widths(widths: list[int], room: int) -> list[int]:
    """Column widths that fit `room` cells (each column pads 2), so every column stays on
    screen: the widest give up cells first, none below MIN_COLUMN, the first (the pair) not
    below PAIR_MIN unless nothing else can give."""
    widths = list(widths)
    floors = [min(width, PAIR_MIN if index == 0 else MIN_COLUMN)
              for index, width in enumerate(widths)]
    while sum(widths) + 2 * len(widths) > room:
        giving = [i for i, width in enumerate(widths) if width > floors[i]]
        if not giving:
            floors = [min(floor, MIN_COLUMN) for floor in floors]
            if all(width <= floor for width, floor in zip(widths, floors, strict=True)):
                break
            continue
        widest = max(giving, key=lambda i: widths[i])
        widths[widest] -= 1
    return widths


def pair_size_gb(pair: dict) -> tuple[float | None, bool]:
    """(known size in GB, whether it is complete); None when no size is known."""
    sizes = [pair[role].get("size_gb") for role in ("target", "drafter")]
    known = [size for size in sizes if size is not None]
    return (sum(known) if known else None), len(known) == len(sizes)


def size_label(size_gb: float | None, complete: bool) -> str:
    if size_gb is None:
        return "?"
    return f"{'' if complete else '>'}{size_gb:.1f} GB"


def best_fit(pair: dict) -> tuple[str, dict] | None:
    """The engine the estimate is shown for, with its entry: the first of the pair's engines
    (in the catalog's order) that runs here; None: none does, or the service gave no fit."""
    fits = pair.get("fit") or {}
    runnable = [engine for engine in pair["engines"] if (fits.get(engine) or {}).get("runs_here")]
    if not runnable:
        return None
    return runnable[0], fits[runnable[0]]


def fits_label(pair: dict) -> Text:
    """Short: the longest context that fits ("131k"), "no", "size" (fits by size only), "?"."""
    chosen = best_fit(pair)
    if chosen is None:
        return Text("n/a", style="dim") if pair.get("fit") else Text("?", style="dim")
    fit = chosen[1].get("fit")
    if fit is None:
        return Text("?", style="dim")
    if fit["max_context"]:
        return Text(f"{fit['max_context'] // 1024}k ctx" if fit["max_context"] >= 1024
                    else f"{fit['max_context']} ctx", style="green")
    if fit["fits"]:
        return Text("size", style="yellow")
    return Text("no", style="red")


def download_fit_warning(fits: dict | None) -> str | None:
    """A download's fit (per engine, worked out as the catalog's) for the engine the picker
    shows; its label where it does not fit, else None (also for an older service's one
    estimate, not per engine)."""
    per_engine = {engine: entry for engine, entry in (fits or {}).items() if isinstance(entry, dict)}
    chosen = best_fit({"engines": list(per_engine), "fit": per_engine})
    estimate = chosen[1].get("fit") if chosen is not None else None
    if estimate is None or estimate["fits"]:
        return None
    return chosen[1]["label"]


def engines_label(pair: dict) -> Text:
    """The engines the pair names; those this machine cannot run are struck through."""
    fits = pair.get("fit") or {}
    label = Text()
    for index, engine in enumerate(pair["engines"]):
        entry = fits.get(engine)
        label.append(", " if index else "")
        label.append(engine, style="dim strike" if entry and not entry.get("runs_here") else "")
    return label


def fit_details(pair: dict) -> list[str]:
    """Per engine: where it runs and the estimate, or why it cannot run here."""
    lines = []
    for engine in pair.get("engines", []):
        entry = (pair.get("fit") or {}).get(engine)
        if entry is None:
            continue
        where = f" on {entry['device']} ({entry['note']})" if entry.get("runs_here") else ""
        line = f"{engine}{where}: {entry['label']}"
        fit = entry.get("fit")
        if fit:
            line += (f" (at {fit['context_tokens']:,} tokens: weights {fit['weights_bytes'] / 1e9:.1f}"
                     f" + KV {(fit['kv_bytes'] + fit['drafter_kv_bytes']) / 1e9:.1f}"
                     f" + state {fit['state_bytes'] / 1e9:.2f} + working {fit['working_bytes'] / 1e9:.1f}"
                     f" = {fit['total_bytes'] / 1e9:.1f} GB of {fit['budget_bytes'] / 1e9:.1f} GB;"
                     f" {fit['basis']})")
        lines.extend([line, *entry.get("notes", [])])
    return lines


def downloaded_label(available: dict, incomplete: dict | None = None) -> Text:
    if incomplete:  # a partial download: the service's words, "incomplete: resume or delete"
        return Text(next(iter(incomplete.values())), style="red")
    target, drafter = available.get("target"), available.get("drafter")
    if target and drafter:
        return Text("yes", style="green")
    if target or drafter:
        return Text("target" if target else "drafter", style="yellow")
    return Text("no", style="dim")


def pair_row(pair: dict) -> tuple:
    size, complete = pair_size_gb(pair)
    return (pair["id"], engines_label(pair), size_label(size, complete),
            fits_label(pair), downloaded_label(pair.get("available", {}), pair.get("incomplete")),
            pair["thinking"], Text("yes", style="bold green") if pair.get("loaded") else "")


def drafter_label(pair: dict) -> str:
    """The drafter's repo, with its DFlash version where it is 2 (servers run it only from a
    release, so the user needs to see it; version 1 stays unmarked)."""
    drafter = pair["drafter"]
    return drafter["repo"] + (" (DFlash 2)" if drafter.get("version", 1) == 2 else "")


def pair_details(pair: dict) -> str:
    lines = [f"{pair['id']}: target {pair['target']['repo']} + drafter {drafter_label(pair)}",
             "block size " + ", ".join(f"{e} {b}" for e, b in pair["block_size"].items())
             + f" | drafter trained with thinking {pair['thinking']}"
             + (" | hybrid target" if pair.get("hybrid") else "")]
    if pair.get("notes"):
        lines.append(pair["notes"])
    size = size_label(*pair_size_gb(pair))
    if size[0] in SIZE_NOTES:
        lines.append(SIZE_NOTES[size[0]])
    lines.extend(fit_details(pair))
    lines.append("Compatibility is checked from the configs before any weights download, and "
                 "again when loading.")
    return "\n".join(lines)


class PickerScreen(Screen):
    CSS_PATH = "picker.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "app.pop_screen", "Back"),
        Binding("l", "load", "Load"),
        Binding("d", "download", "Download"),
        Binding("c", "cancel_download", "Cancel download"),
        Binding("r", "refresh", "Refresh"),
    ]

    class Listed(Message):
        def __init__(self, pairs: list[dict], memory: dict):
            super().__init__()
            self.pairs, self.memory = pairs, memory

    class Outcome(Message):
        """A load or download request ended; `error` is the service's explanation."""

        def __init__(self, action: str, pair_id: str, error: str | None):
            super().__init__()
            self.action, self.pair_id, self.error = action, pair_id, error

    class LoadPhase(Message):
        """The service says what a pending load is doing ("calibrating")."""

        def __init__(self, pair_id: str, phase: str):
            super().__init__()
            self.pair_id, self.phase = pair_id, phase

    class Progress(Message):
        def __init__(self, snapshot: dict):
            super().__init__()
            self.snapshot = snapshot

    def __init__(self, load_when_listed: str | None = None):
        super().__init__()
        self.load_when_listed = load_when_listed  # a preset's pair, loaded as `l` would
        self.pairs: list[dict] = []
        self.download_id: str | None = None
        self.download_pair: str | None = None  # the pair the download line is about

    def compose(self) -> ComposeResult:
        yield Static("Models: [b]l[/b] load, [b]d[/b] download, [b]c[/b] cancel, Esc back",
                     id="picker-title")
        yield DataTable(cursor_type="row", zebra_stripes=True, id="pairs")
        yield Static(id="details", markup=False)
        yield ProgressBar(id="progress", show_eta=False)
        yield Static(id="download-status", markup=False)
        yield Static(id="message", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(ProgressBar).display = False  # until a download starts
        self._add_columns([])
        self.query_one(DataTable).focus()
        self.action_refresh()

    def _add_columns(self, pairs: list[dict]) -> None:
        """The pair column as wide as the longest id, where the screen has the room."""
        table = self.query_one(DataTable)
        table.clear(columns=True)
        wanted = [width for _, width in COLUMNS]
        wanted[0] = max([wanted[0], *(len(pair["id"]) for pair in pairs)])
        widths = fitted_widths(wanted, self.app.size.width - 2)  # the table's scrollbar
        for (label, _), width in zip(COLUMNS, widths, strict=True):
            table.add_column(label, width=width)

    def selected_pair(self) -> dict | None:
        table = self.query_one(DataTable)
        if not self.pairs or table.cursor_row is None:
            return None
        return self.pairs[table.cursor_row]

    # --- workers post; handlers own the state ---

    @work(exclusive=True, group="picker-list")
    async def action_refresh(self) -> None:
        app = self.app
        await app.service_ready.wait()
        try:
            pairs, status = await app.client.catalog(), await app.client.status()
        except ServiceError as exc:
            self.post_message(self.Outcome("list", "", exc.message))
            return
        self.post_message(self.Listed(pairs, status.get("memory") or {}))

    def on_picker_screen_listed(self, message: Listed) -> None:
        table = self.query_one(DataTable)
        row = table.cursor_row
        self.pairs = message.pairs
        self.app.catalog = message.pairs
        self._add_columns(message.pairs)
        for pair in message.pairs:
            table.add_row(*pair_row(pair), key=pair["id"])
        if self.pairs:
            table.move_cursor(row=min(row or 0, len(self.pairs) - 1))
        wanted, self.load_when_listed = self.load_when_listed, None
        ids = [pair["id"] for pair in self.pairs]
        if wanted in ids:
            table.move_cursor(row=ids.index(wanted))
            self.action_load()
        elif wanted is not None:
            self.query_one("#message", Static).update(Text(
                f"Not loaded: {wanted} is not in this service's catalog", style="bold red"))

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        pair = self.selected_pair()
        self.query_one("#details", Static).update(pair_details(pair) if pair else "")
        # a finished download's line belongs under its own pair; a running one stays in view
        status = self.query_one("#download-status", Static)
        status.display = self.download_id is not None or (
            pair is not None and pair["id"] == self.download_pair)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.action_load()

    def action_load(self) -> None:
        pair = self.selected_pair()
        if pair is not None and pair.get("loaded"):
            self.notify(f"{pair['id']} is already loaded", severity="warning")
        elif pair is not None:
            self.query_one("#message", Static).update(f"Loading {pair['id']}...")
            self.app.service_state = f"loading {pair['id']}"
            self._load(pair["id"])

    @work(exclusive=True, group="picker-load")
    async def _load(self, pair_id: str) -> None:
        loading = asyncio.create_task(self.app.client.load_pair(pair_id))
        try:
            while not loading.done():
                await asyncio.wait({loading}, timeout=LOAD_POLL_S)
                if not loading.done():
                    await self._show_load_phase(pair_id)
            await loading
        except ServiceError as exc:
            self.post_message(self.Outcome("load", pair_id, exc.message))
            return
        finally:
            loading.cancel()  # a no-op once done; else this worker was cancelled
        self.post_message(self.Outcome("load", pair_id, None))

    async def _show_load_phase(self, pair_id: str) -> None:
        """A first load with block size auto measures this machine (~20-30 s): say so."""
        try:
            status = await self.app.client.status()
        except ServiceError:
            return
        if status.get("loading_phase") == PHASE_CALIBRATING:
            self.post_message(self.LoadPhase(pair_id, PHASE_CALIBRATING))

    def on_picker_screen_load_phase(self, message: LoadPhase) -> None:
        self.query_one("#message", Static).update(
            f"Calibrating {message.pair_id}: measuring this machine's round costs, once per pair...")
        self.app.service_state = f"{message.phase} {message.pair_id}"

    def on_unmount(self) -> None:
        # Esc during a load cancels this screen's worker before it reports: ask the service
        self.app.refresh_status()

    def on_picker_screen_outcome(self, message: Outcome) -> None:
        text = self.query_one("#message", Static)
        if message.error:
            verb = {"load": "Refused to load", "download": "Download failed"}.get(
                message.action, "The service answered")
            text.update(Text(f"{verb} {message.pair_id}: {message.error}", style="bold red"))
        elif message.action == "cancel":  # the download's own events say when it has stopped
            text.update("Cancelling the download...")
            return
        else:
            text.update(Text(f"{message.action} {message.pair_id}: done", style="green"))
        if message.action == "load":
            self.app.refresh_status()
        if message.action != "list":
            self.action_refresh()

    def action_download(self) -> None:
        pair = self.selected_pair()
        if pair is not None:
            self.download_pair = pair["id"]
            self.query_one("#download-status", Static).display = True
            self._download(pair["id"])

    @work(exclusive=True, group="picker-download")
    async def _download(self, pair_id: str) -> None:
        client = self.app.client
        try:
            started = await client.start_download(pair_id)
            async for snapshot in client.download_events(started["id"]):
                self.post_message(self.Progress(snapshot))
        except ServiceError as exc:
            self.post_message(self.Outcome("download", pair_id, exc.message))

    def on_picker_screen_progress(self, message: Progress) -> None:
        snap = message.snapshot
        self.download_id = snap.get("id")
        bar = self.query_one(ProgressBar)
        bar.display = True
        bar.update(total=snap.get("bytes_total") or None, progress=snap.get("bytes_done", 0))
        line = f"{snap.get('label')}: {snap['status']}"
        if snap.get("bytes_total"):
            line += f" {snap['bytes_done'] / 1e9:.2f}/{snap['bytes_total'] / 1e9:.2f} GB"
        if snap.get("repo"):
            line += f" ({snap['repo']})"
        if (warning := download_fit_warning(snap.get("fit"))) is not None:
            line += f" | warning: {warning}"
        if snap["status"] in ("failed", "cancelled"):  # no bar left pulsing at "--%"
            bar.display = False
            line += f": {snap['error']}" if snap.get("error") else ""
        self.query_one("#download-status", Static).update(
            Text(line, style="bold red") if snap["status"] == "failed" else Text(line))
        if snap["status"] in ("done", "failed", "cancelled"):
            self.download_id = None
            self.post_message(self.Outcome("download", snap.get("label", ""), snap.get("error")))

    def action_cancel_download(self) -> None:
        if self.download_id is None:
            self.notify("No download is running: nothing to cancel", severity="warning")
            return
        self._cancel(self.download_id)

    @work(group="picker-cancel")
    async def _cancel(self, download_id: str) -> None:
        try:
            await self.app.client.cancel_download(download_id)
        except ServiceError as exc:
            self.post_message(self.Outcome("cancel", download_id, exc.message))
            return
        self.post_message(self.Outcome("cancel", download_id, None))
