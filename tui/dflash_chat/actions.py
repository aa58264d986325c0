"""Every user action, defined once: its id (binding id, keymap key, action method), default
keys, title and where it runs. The bindings, the command palette, the help screen and the
settings' keymap are all built from this table, so they cannot disagree.

Plain data: no Textual import.
"""

from __future__ import annotations

from dataclasses import dataclass

APP = "app"  # runs on the App, from any screen
CHAT = "chat"  # runs on the chat screen (the palette brings it to the front first)


@dataclass(frozen=True)
class ActionSpec:
    id: str  # action method name (action_<id>), binding id and keymap key
    keys: str  # default keys, comma separated, in Textual's key names
    title: str  # palette title and help text
    footer: str = ""  # short footer label; empty = not shown in the footer
    scope: str = CHAT


ACTIONS: tuple[ActionSpec, ...] = (
    ActionSpec("help", "f1", "Help: list the keys", "Help", APP),
    ActionSpec("toggle_speculative", "f2,ctrl+s", "Toggle speculative decoding (next message)",
               "Spec"),
    ActionSpec("toggle_accepted", "f3", "Tint accepted drafts (drafter green, copied amber)", "Colour"),
    ActionSpec("race", "f4", "Race: plain vs speculative on one prompt", "Race", APP),
    ActionSpec("models", "f5", "Models: catalog, download, load", "Models", APP),
    ActionSpec("settings", "f6", "Settings: sampling, theme, keys", "Settings", APP),
    ActionSpec("rename_chat", "f7", "Rename this chat"),
    ActionSpec("system_prompt", "f8", "Set this chat's system prompt"),
    ActionSpec("export_chat", "f9", "Export this chat to Markdown"),
    ActionSpec("toggle_dark", "f10", "Switch light / dark theme", "", APP),
    ActionSpec("stop", "escape", "Stop the reply (keeps the partial text)", "Stop"),
    ActionSpec("new_chat", "ctrl+n", "New chat", "New"),
    ActionSpec("regenerate", "ctrl+r", "Regenerate the last reply (keeps the earlier one)"),
    ActionSpec("edit_last", "ctrl+o", "Edit the selected (or last) prompt as a new version"),
    ActionSpec("copy_message", "ctrl+y", "Copy the selected (or last) reply"),
    ActionSpec("copy_code", "ctrl+b", "Copy a reply's last code block (again: the one before)"),
    ActionSpec("toggle_thinking", "ctrl+t", "Thinking: auto / on / off"),
    ActionSpec("presets", "alt+p", "Presets: apply one to this chat, or save its values"),
    ActionSpec("toggle_overflow", "alt+o", "Context overflow: drop oldest / refuse / keep last turns"),
    ActionSpec("delete_chat", "ctrl+g", "Delete this chat"),
    ActionSpec("delete_message", "alt+d", "Delete the selected message and what follows it"),
    ActionSpec("restore_chat", "alt+z", "Bring back the chat deleted last"),
    ActionSpec("search_chats", "ctrl+f", "Search past chats"),
    ActionSpec("edit_in_editor", "ctrl+e", "Edit the prompt in $EDITOR"),
    ActionSpec("toggle_chats", "ctrl+l", "Show or hide the chat list", "Chats"),
    ActionSpec("toggle_speed", "ctrl+backslash", "Show or hide the speed panel"),
    ActionSpec("drafter", "alt+a", "Drafter: what it learnt of your replies, tau over time"),
    ActionSpec("restart_service", "ctrl+right_square_bracket", "Restart the service", "", APP),
)

# Keys the widgets handle themselves: listed in help, not remappable.
FIXED_KEYS: tuple[tuple[str, str], ...] = (
    ("enter", "Send the prompt"),
    ("ctrl+j, shift+enter, alt+enter",
     "New line in the prompt (Shift/Alt where the terminal reports them)"),
    ("@path", "In a prompt: attach that text file"),
    ("left / right", "On a message with versions (regenerated, edited): the one before / after"),
    ("up / down", "Prompt history (on the prompt's first / last line)"),
    ("tab / shift+tab", "Move focus (chats, messages, prompt)"),
    ("ctrl+p", "Command palette: every action"),
    ("ctrl+q", "Quit"),
)

BY_ID = {spec.id: spec for spec in ACTIONS}


def effective_keys(spec: ActionSpec, keymap: dict[str, str]) -> str:
    """The keys an action answers to once the user's keymap is applied."""
    return keymap.get(spec.id, spec.keys)


KEY_SYMBOLS = {"right_square_bracket": "]", "left_square_bracket": "[", "backslash": "\\"}


def key_label(keys: str) -> str:
    """Keys as people read them: "ctrl+right_square_bracket,f4" -> "ctrl+], f4"."""
    labels = []
    for key in (k.strip() for k in keys.split(",") if k.strip()):
        *modifiers, name = key.split("+")
        labels.append("+".join([*modifiers, KEY_SYMBOLS.get(name, name)]))
    return ", ".join(labels)


def check_keymap(keymap: dict[str, str]) -> list[str]:
    """Problems with a user keymap: unknown action ids, empty keys, one key for two actions."""
    problems = [f"unknown action {action!r} in the keymap" for action in keymap if action not in BY_ID]
    owners: dict[str, str] = {}
    for spec in ACTIONS:
        keys = effective_keys(spec, keymap)
        if not keys.strip():
            problems.append(f"action {spec.id!r} has no key")
        for key in (k.strip() for k in keys.split(",") if k.strip()):
            if key in owners:
                problems.append(f"key {key!r} is bound to both {owners[key]!r} and {spec.id!r}")
            owners[key] = spec.id
    return problems
