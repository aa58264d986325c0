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

COLUMNS = (("Pair", 22), ("Runs on", 26), ("Size", 9), ("Fits", 6), ("Downloaded", 10),
           ("Thinking", 8), ("", 6))


def pair_size_gb(pair: dict) -> tuple[float | None, bool]:
    """(known size in GB, whether it is complete); None when no size is known."""
    sizes = [pair[role].get("size_gb") for role in ("target", "drafter")]
    known = [size for size in sizes if size is not None]
    return (sum(known) if known else None), len(known) == len(sizes)


def size_label(size_gb: float | None, complete: bool) -> str:
    if size_gb is None:
        return "?"
    return f"{'' if complete else '>'}{size_gb:.1f} GB"


def fits_label(size_gb: float | None, complete: bool, memory: dict) -> Text:
    if size_gb is None or not memory:
        return Text("?", style="dim")
    needed = size_gb * 1e9
    if needed > memory.get("total_bytes", 0):
        return Text("no", style="red")
    if not complete:
        return Text("?", style="dim")
    if needed <= memory.get("available_bytes", 0):
        return Text("yes", style="green")
    return Text("tight", style="yellow")


def downloaded_label(available: dict, incomplete: dict | None = None) -> Text:
    if incomplete:  # a partial download: the service's words, "incomplete: resume or delete"
        return Text(next(iter(incomplete.values())), style="red")
    target, drafter = available.get("target"), available.get("drafter")
    if target and drafter:
        return Text("yes", style="green")
    if target or drafter:
        return Text("target" if target else "drafter", style="yellow")
    return Text("no", style="dim")


def pair_row(pair: dict, memory: dict) -> tuple:
    size, complete = pair_size_gb(pair)
    return (pair["id"], ", ".join(pair["engines"]), size_label(size, complete),
            fits_label(size, complete, memory), downloaded_label(pair.get("available", {}), pair.get("incomplete")),
            pair["thinking"], Text("loaded", style="bold green") if pair.get("loaded") else "")


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
            self.pairs = pairs
            self.memory = memory

    class Outcome(Message):
        """A load or download request ended; `error` is the service's explanation."""

        def __init__(self, action: str, pair_id: str, error: str | None):
            super().__init__()
            self.action = action
            self.pair_id = pair_id
            self.error = error

    class LoadPhase(Message):
        """The service says what a pending load is doing ("calibrating")."""

        def __init__(self, pair_id: str, phase: str):
            super().__init__()
            self.pair_id = pair_id
            self.phase = phase

    class Progress(Message):
        def __init__(self, snapshot: dict):
            super().__init__()
            self.snapshot = snapshot

    def __init__(self):
        super().__init__()
        self.pairs: list[dict] = []
        self.download_id: str | None = None

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
        table = self.query_one(DataTable)
        for label, width in COLUMNS:
            table.add_column(label, width=width)
        table.focus()
        self.action_refresh()

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
        table.clear()
        for pair in message.pairs:
            table.add_row(*pair_row(pair, message.memory), key=pair["id"])
        if self.pairs:
            table.move_cursor(row=min(row or 0, len(self.pairs) - 1))

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        pair = self.selected_pair()
        self.query_one("#details", Static).update(pair_details(pair) if pair else "")

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.action_load()

    def action_load(self) -> None:
        pair = self.selected_pair()
        if pair is not None:
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
        fit = snap.get("fit") or {}
        if fit and not fit.get("fits"):
            line += " | warning: it may not fit in memory"
        self.query_one("#download-status", Static).update(line)
        if snap["status"] in ("done", "failed", "cancelled"):
            self.download_id = None
            self.post_message(self.Outcome("download", snap.get("label", ""), snap.get("error")))

    def action_cancel_download(self) -> None:
        if self.download_id is not None:
            self._cancel(self.download_id)

    @work(group="picker-cancel")
    async def _cancel(self, download_id: str) -> None:
        try:
            await self.app.client.cancel_download(download_id)
        except ServiceError as exc:
            self.post_message(self.Outcome("cancel", download_id, exc.message))
            return
        self.post_message(self.Outcome("cancel", download_id, None))
