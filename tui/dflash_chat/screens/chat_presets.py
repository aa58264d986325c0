"""The chat screen's presets: apply a named bundle of system prompt, a chat's own values and the
pair to the open chat (a new one if none is open), or save the open chat's under a name. A
preset's pair, when another is loaded, is loaded by the model picker (its progress and refusals
shown there). A preset never changes the saved defaults (settings.toml): a chat's values are its
own."""

from __future__ import annotations

from dataclasses import replace

from dflash_chat.screens.dialogs import TextDialog
from dflash_chat.settings import CHAT_FIELDS
from dflash_chat.storage import Preset, StoreError


class PresetActions:
    """Mixed into ChatScreen (which owns the conversation and `_set_chat_value`)."""

    def action_presets(self) -> None:
        from dflash_chat.screens.presets import PresetScreen

        async def chosen(result: tuple[str, str] | None) -> None:
            if result is None:
                return
            what, name = result
            if what == "save":
                self._ask_preset_name()
            else:
                await self._apply_preset(name)

        self.app.push_screen(PresetScreen(self.app.store.presets()), chosen)

    def _ask_preset_name(self) -> None:
        store = self.app.store
        chat_id = self.conversation.chat_id
        system_prompt = store.chat(chat_id).system_prompt if chat_id is not None else ""

        def save(name: str | None) -> None:
            if not name or not name.strip():
                return
            values = {field: getattr(self.app.settings, field) for field in CHAT_FIELDS}
            if pair := self.app.chat_settings()["pair"]:
                values["pair"] = pair
            if self._write(store.save_preset, Preset(name.strip(), system_prompt, values)):
                self.notify(f"Preset {name.strip()!r} saved "
                            f"({self.app.keys_of('presets')} applies it to a chat)")

        self.app.push_screen(TextDialog("Save this chat's values as the preset", "",
                                        "a name, e.g. precise coder"), save)

    async def _apply_preset(self, name: str) -> None:
        preset = next((p for p in self.app.store.presets() if p.name == name), None)
        if preset is None:
            return
        values = {field: value for field, value in preset.settings.items() if field in CHAT_FIELDS}
        try:
            problems = replace(self.app.settings, **values).problems()
        except TypeError as exc:  # a value of another type than this app's setting
            problems = [str(exc)]
        if problems:  # a preset an older app saved, with a value this one refuses
            self.notify("; ".join(problems), title=f"Preset {name!r} not applied",
                        severity="error")
            return
        try:
            if self.conversation.chat_id is None:
                await self._open_new_chat("New chat")
            self.app.store.set_system_prompt(self.conversation.chat_id, preset.system_prompt)
        except StoreError as exc:
            self._not_written(exc)
            return
        self._set_chat_value(**values)
        self.notify(f"Preset {name!r} applied to this chat (from the next message)")
        pair = preset.settings.get("pair")
        if pair and pair != self.app.chat_settings()["pair"]:
            from dflash_chat.screens.picker import PickerScreen

            self.app.push_screen(PickerScreen(load_when_listed=pair))
