"""dflash-chat: the App and its connection to the service (its flags: command_line.py).

The chat screen is usable at once; the service (a child process, or `--server URL`) starts in a
worker, and its state shows in the status bar until it answers. Prompts sent before then wait
for it (`service_ready`).
"""

from __future__ import annotations

import asyncio
from dataclasses import fields, replace
from pathlib import Path

from textual import work
from textual.app import App
from textual.message import Message
from textual.reactive import var

from dflash_chat.actions import APP, BY_ID, effective_keys, key_label
from dflash_chat.adapt_view import AdaptState, adapt_state
from dflash_chat.bindings import bindings_for
from dflash_chat.command_line import Options, build_parser, options_from_args
from dflash_chat.commands import DFlashCommands
from dflash_chat.protocol import PHASE_EXPLAINED, ServiceError, describe_loaded
from dflash_chat.screens.chat import ChatScreen
from dflash_chat.service import HEALTH_EVERY_S, ServiceProcess, ServiceStartError, wait_healthy
from dflash_chat.settings import (
    CHAT_FIELDS,
    THEMES_DARK_LIGHT,
    Settings,
    load_settings,
    save_settings,
    settings_path,
)
from dflash_chat.storage import DB_NAME
from dflash_chat.store_open import open_store


class DFlashChatApp(App):
    TITLE = "dflash-chat"
    CSS_PATH = "app.tcss"
    BINDINGS = bindings_for(APP)
    COMMANDS = App.COMMANDS | {DFlashCommands}

    settings: var[Settings] = var(Settings, init=False)
    service_state: var[str] = var("starting")  # starting | loading ... | ready | error: ...
    model_label: var[str] = var("")
    adapt: var[AdaptState] = var(AdaptState)  # the drafter's adaptation, from /dflash/status

    def __init__(self, options: Options | None = None, *, data_dir: Path | None = None,
                 settings_file: Path | None = None, settings: Settings | None = None):
        super().__init__()
        from dflash_local import paths  # platformdirs only: no model code

        self.options = options or Options()
        self.data_dir = data_dir or paths.data_dir_path()  # the store creates it, or says why not
        self.settings_file = settings_file or settings_path()
        loaded, self.settings_problems = load_settings(self.settings_file)
        self.defaults = settings or loaded  # the user's, as saved; `settings` is the open chat's
        self.set_reactive(DFlashChatApp.settings, self.defaults)
        opened = open_store(self.data_dir / DB_NAME)  # damaged, read-only or full: it says so
        self.store, self.store_problem = opened.store, opened.problem
        self.client = None  # a DFlashClient once connected
        self.process: ServiceProcess | None = None
        self.service_ready = asyncio.Event()
        self.status: dict = {}  # the last GET /dflash/status
        self.catalog: list[dict] = []
        self.chat_screen: ChatScreen | None = None
        self._health_timer = None  # the health watch, once the service has answered

    def on_mount(self) -> None:
        self.chat_screen = ChatScreen()
        self.theme = self.settings.theme
        self.set_keymap(self.settings.keymap)
        self.theme_changed_signal.subscribe(self, self._remember_theme)
        self.push_screen(self.chat_screen)
        for problem in self.settings_problems:
            self.notify(problem, severity="warning", timeout=10)
        if self.store_problem:
            self.notify(self.store_problem, title="Chat history", severity="error", timeout=60)
        if self.options.connect:
            self._start_service()
        else:
            self.service_state = "offline"

    async def on_unmount(self) -> None:
        if self.client is not None:
            await self.client.aclose()
        if self.process is not None:  # also when it is still starting: no orphan child
            await self.process.stop()
        self.store.close()

    # --- the service: workers fetch and post; the handlers below own the state ---

    class ServiceUp(Message):
        def __init__(self, client, status: dict):
            super().__init__()
            self.client = client
            self.status = status

    class ServiceDown(Message):
        def __init__(self, reason: str):
            super().__init__()
            self.reason = reason

    class StatusFetched(Message):
        def __init__(self, status: dict | None, error: str | None = None):
            super().__init__()
            self.status = status
            self.error = error

    class CatalogFetched(Message):
        def __init__(self, pairs: list[dict], error: str | None = None):
            super().__init__()
            self.pairs = pairs
            self.error = error

    def _start_service(self) -> None:
        if self.options.server is None:
            serve_args = [*self.options.serve_args, *self.defaults.serve_flags()]
            self.process = ServiceProcess(serve_args, self.service_log, env=self.options.env,
                                          on_phase=self._show_phase,
                                          command=self.options.serve_command)
            self.service_state = "loading model"
        self._connect(self.process)

    @work(exclusive=True, group="service")
    async def _connect(self, process: ServiceProcess | None) -> None:
        from dflash_chat.client import DFlashClient  # httpx loads after the first paint

        client = None
        try:
            if process is None:
                client = DFlashClient(self.options.server, self.options.api_key)
                await wait_healthy(client)
            else:
                client = DFlashClient(await process.start(), process.api_key)
                await process.wait_healthy(client)
            self.post_message(self.ServiceUp(client, await client.status()))
        except (ServiceError, ServiceStartError, OSError) as exc:
            if client is not None:
                await client.aclose()
            self.post_message(self.ServiceDown(str(exc)))

    @property
    def service_log(self) -> Path:
        """Where the child's log goes (its process says: elsewhere if the data dir is read-only)."""
        return self.process.log_path if self.process else self.data_dir / "logs" / "service.log"

    def on_dflash_chat_app_service_up(self, message: ServiceUp) -> None:
        self.client = message.client
        if self._health_timer is None:
            self._health_timer = self.set_interval(HEALTH_EVERY_S, self._check_health)
        self.on_dflash_chat_app_status_fetched(self.StatusFetched(message.status))
        self.service_ready.set()
        self.fetch_catalog()
        if not message.status.get("loaded"):
            reason = message.status.get("load_error") or (
                self.process.last_warning() if self.process else None)
            self.notify((f"{reason}\n" if reason else "") + f"{self.keys_of('models')} opens the model picker.",
                        title="No model is loaded", severity="warning", timeout=30)

    class ServicePhase(Message):
        """What the starting service waits for ("calibrating embedded"), from its stdout."""

        def __init__(self, phase: str):
            super().__init__()
            self.phase = phase

    def _show_phase(self, phase: str) -> None:
        self.post_message(self.ServicePhase(phase))

    def on_dflash_chat_app_service_phase(self, message: ServicePhase) -> None:
        self.service_state = message.phase
        phase, _, pair = message.phase.partition(" ")
        if phase in PHASE_EXPLAINED:  # what the wait is, and that it does not come back
            self.notify(PHASE_EXPLAINED[phase].format(pair=pair), title="Preparing the model",
                        timeout=30)

    def on_dflash_chat_app_service_down(self, message: ServiceDown) -> None:
        self.service_state = "service failed"
        self.notify(message.reason, title="The service did not start", severity="error",
                    timeout=30)

    # --- the health watch: a dead service says so, and a key restarts it ---

    class ServiceLost(Message):
        def __init__(self, reason: str):
            super().__init__()
            self.reason = reason

    @work(exclusive=True, group="health")
    async def _check_health(self) -> None:
        if self.client is None or not self.service_ready.is_set():
            return
        if self.process is not None and not self.process.running:
            self.post_message(self.ServiceLost(f"the service exited ({self.process.exit_status})"))
            return
        try:
            await self.client.health()
        except ServiceError as exc:
            self.post_message(self.ServiceLost(exc.message))

    def on_dflash_chat_app_service_lost(self, message: ServiceLost) -> None:
        if not self.service_ready.is_set():
            return  # already said, or restarting
        self.service_ready.clear()  # prompts wait for a restart instead of failing
        self.service_state = "service stopped"
        keys = self.keys_of("restart_service")
        tail = f"\n{self.process.log_tail()}" if self.process is not None else ""
        self.notify(f"{message.reason}. {keys} restarts it; its log: {self.service_log}{tail}",
                    title="The service stopped", severity="error", timeout=30)

    def keys_of(self, action_id: str) -> str:
        """An action's keys as the user's keymap has them, written as people read them."""
        return key_label(effective_keys(BY_ID[action_id], self.settings.keymap))

    async def action_restart_service(self) -> None:
        """Start the service again (or reconnect to --server): for a dead or stuck service."""
        self.service_ready.clear()
        self.service_state = "starting"
        if self.client is not None:
            await self.client.aclose()
            self.client = None
        if self.process is not None:
            await self.process.stop()
        self._start_service()

    @work(group="status")
    async def refresh_status(self) -> None:
        """GET /dflash/status; the handler updates `status`, `service_state`, `model_label`."""
        if self.client is None:
            return
        try:
            self.post_message(self.StatusFetched(await self.client.status()))
        except ServiceError as exc:
            self.post_message(self.StatusFetched(None, exc.message))

    def on_dflash_chat_app_status_fetched(self, message: StatusFetched) -> None:
        if message.status is None:
            self.service_state = f"error: {message.error}"
            return
        self.status = message.status
        loaded = self.status.get("loaded")
        if self.status.get("loading"):
            phase = self.status.get("loading_phase") or "loading"
            self.service_state = f"{phase} {self.status['loading']}"
        else:
            self.service_state = "ready" if loaded else "no model loaded"
        self.model_label = describe_loaded(loaded)
        self.adapt = adapt_state(self.status)

    @work(group="catalog")
    async def fetch_catalog(self) -> None:
        try:
            self.post_message(self.CatalogFetched(await self.client.catalog()))
        except ServiceError as exc:
            self.post_message(self.CatalogFetched([], exc.message))

    def on_dflash_chat_app_catalog_fetched(self, message: CatalogFetched) -> None:
        if message.error:
            self.notify(f"The catalog could not be read: {message.error}", severity="warning")
        self.catalog = message.pairs
        self.mutate_reactive(DFlashChatApp.settings)  # re-check the thinking warning

    def loaded_context(self) -> int | None:
        """The loaded pair's context in tokens (None: no pair, or a service that does not say)."""
        return (self.status.get("loaded") or {}).get("max_context")

    def served_model(self) -> str:
        return (self.status.get("loaded") or {}).get("served_name") or ""

    def catalog_pair(self, pair_id: str | None) -> dict | None:
        return next((pair for pair in self.catalog if pair["id"] == pair_id), None)

    def thinking_warning(self) -> str:
        """A warning when the thinking mode differs from the one the drafter was trained for."""
        loaded = self.status.get("loaded") or {}
        pair = self.catalog_pair(loaded.get("pair"))
        trained = pair["thinking"] if pair else "none"
        wanted = self.settings.thinking
        if trained == "none" and pair and wanted == "on":
            return f"{pair['id']} has no thinking mode: thinking on changes nothing"
        if trained in ("on", "off") and wanted != "auto" and wanted != trained:
            return f"the drafter was trained with thinking {trained}: expect a lower tau"
        return ""

    # --- settings ---

    def chat_settings(self) -> dict:
        """What a chat keeps of the settings it was sent with: the pair and the sampling."""
        loaded = self.status.get("loaded") or {}
        return {"pair": loaded.get("pair") or loaded.get("served_name"),
                **{name: getattr(self.settings, name) for name in CHAT_FIELDS}}

    def apply_chat_settings(self, chat) -> None:
        """The open chat's own values (the defaults for those it lacks, or for a new chat, None)
        apply to it alone: the saved defaults stay. A different pair is pointed out."""
        stored = chat.settings if chat is not None else {}
        own = {name: stored.get(name, getattr(self.defaults, name)) for name in CHAT_FIELDS}
        wanted = replace(self.settings, **own)
        if wanted.problems():  # a value the app no longer accepts: the defaults instead
            wanted = replace(self.settings, **{n: getattr(self.defaults, n) for n in CHAT_FIELDS})
        self._use(wanted)
        pair = stored.get("pair")
        loaded = (self.status.get("loaded") or {}).get("pair")
        if pair and loaded and pair != loaded:
            self.notify(f"This chat was written with {pair}; {loaded} is loaded "
                        f"({self.keys_of('models')}: models)",
                        severity="warning")

    def update_settings(self, **changes) -> None:
        """A key's change applies now: a chat value (F2) to the open chat, an app-wide one saved."""
        self._use(replace(self.settings, **changes))
        app_wide = {name: value for name, value in changes.items() if name not in CHAT_FIELDS}
        if app_wide:
            self._save_defaults(replace(self.defaults, **app_wide))

    def save_defaults(self, defaults: Settings) -> None:
        """The settings screen's save: the user's defaults; what changed applies to the open
        chat too (what did not keeps the chat's own value)."""
        changed = {spec.name: getattr(defaults, spec.name) for spec in fields(Settings)
                   if getattr(defaults, spec.name) != getattr(self.defaults, spec.name)}
        self._use(replace(self.settings, **changed))
        self._save_defaults(defaults)

    def _use(self, settings: Settings) -> None:
        self.settings = settings
        self.set_keymap(settings.keymap)
        if self.theme != settings.theme:
            self.theme = settings.theme

    def _save_defaults(self, defaults: Settings) -> None:
        self.defaults = defaults
        try:
            save_settings(defaults, self.settings_file)
        except OSError as exc:
            self.notify(f"settings not saved: {exc}", severity="error")

    def _remember_theme(self, theme) -> None:
        if theme.name != self.settings.theme:
            self.update_settings(theme=theme.name)

    # --- actions (ids in actions.py) ---

    def action_help(self) -> None:
        from dflash_chat.screens.help import HelpScreen

        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(self.settings.keymap,
                                        self.service_log if self.process else None))

    def action_race(self) -> None:
        from dflash_chat.screens.race import RaceScreen

        self._open(RaceScreen)

    def action_models(self) -> None:
        from dflash_chat.screens.picker import PickerScreen

        self._open(PickerScreen)

    def action_settings(self) -> None:
        from dflash_chat.screens.settings import SettingsScreen

        self._open(SettingsScreen)

    def _open(self, screen_class) -> None:
        """Open a screen over the chat (not a second copy of it)."""
        if isinstance(self.screen, screen_class):
            return
        while self.screen is not self.chat_screen and len(self.screen_stack) > 2:
            self.pop_screen()
        self.push_screen(screen_class())

    def action_toggle_dark(self) -> None:
        dark, light = THEMES_DARK_LIGHT
        self.update_settings(theme=light if self.current_theme.dark else dark)

    async def run_named_action(self, action_id: str) -> None:
        """Run an action from the palette: chat actions run on the chat screen, brought up."""
        spec = BY_ID[action_id]
        if spec.scope == APP:
            await self.run_action(action_id)
            return
        while self.screen is not self.chat_screen and len(self.screen_stack) > 2:
            self.pop_screen()
        await self.chat_screen.run_action(action_id)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.server and (args.pair or args.target or args.drafter):
        build_parser().error("--server uses the pair that server has loaded: drop --pair/--target")
    DFlashChatApp(options_from_args(args)).run()
    return 0
