"""The command palette (Ctrl+P): every action of the table in actions.py, with its keys.

Labels are plain Content, never markup: a key hint such as "[f4]" would read as a style tag."""

from __future__ import annotations

from functools import partial

from textual.command import DiscoveryHit, Hit, Hits, Provider
from textual.content import Content

from dflash_chat.actions import ACTIONS, ActionSpec, effective_keys, key_label

MATCH_STYLE = "bold reverse"


def palette_label(spec: ActionSpec, keymap: dict[str, str]) -> str:
    return f"{spec.title}  [{key_label(effective_keys(spec, keymap))}]"


class DFlashCommands(Provider):
    def _entries(self) -> list[tuple[ActionSpec, str]]:
        keymap = self.app.settings.keymap
        return [(spec, palette_label(spec, keymap)) for spec in ACTIONS]

    def _command(self, spec: ActionSpec):
        return partial(self.app.run_named_action, spec.id)

    async def discover(self) -> Hits:
        for spec, label in self._entries():
            yield DiscoveryHit(Content(label), self._command(spec), text=label, help=spec.id)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for spec, label in self._entries():
            score, offsets = matcher.fuzzy_search.match(query, label)
            if score > 0:
                display = Content(label)
                for offset in offsets:
                    display = display.stylize(MATCH_STYLE, offset, offset + 1)
                yield Hit(score, display, self._command(spec), text=label, help=spec.id)
