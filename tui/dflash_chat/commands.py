"""The command palette (Ctrl+P): every action of the table in actions.py, with its keys."""

from __future__ import annotations

from functools import partial

from textual.command import DiscoveryHit, Hit, Hits, Provider

from dflash_chat.actions import ACTIONS, ActionSpec, effective_keys


class DFlashCommands(Provider):
    def _entries(self) -> list[tuple[ActionSpec, str]]:
        keymap = self.app.settings.keymap
        return [(spec, f"{spec.title}  [{effective_keys(spec, keymap)}]") for spec in ACTIONS]

    def _command(self, spec: ActionSpec):
        return partial(self.app.run_named_action, spec.id)

    async def discover(self) -> Hits:
        for spec, label in self._entries():
            yield DiscoveryHit(label, self._command(spec), help=spec.id)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for spec, label in self._entries():
            score = matcher.match(label)
            if score > 0:
                yield Hit(score, matcher.highlight(label), self._command(spec), text=label,
                          help=spec.id)
