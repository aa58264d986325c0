"""Textual bindings built from the action table (actions.py); the user's keymap applies to them
through `App.set_keymap`, by binding id."""

from __future__ import annotations

from textual.binding import Binding

from dflash_chat.actions import ACTIONS


def bindings_for(scope: str) -> list[Binding]:
    return [Binding(spec.keys, spec.id, spec.footer or spec.title, show=bool(spec.footer),
                    id=spec.id, tooltip=spec.title)
            for spec in ACTIONS if spec.scope == scope]
