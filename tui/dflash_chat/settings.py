"""The app's settings, kept in `config_dir_path()/settings.toml`: read with tomllib, written by the
small serializer below (flat keys plus one [keymap] table, all we need).

Boundary: no Textual. A bad value in the file never stops the app: it falls back to the default
and the problem is reported (`load_settings` returns the problems).
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from dflash_chat.actions import check_keymap

THINKING_MODES = ("auto", "on", "off")  # auto: the chat template's default
# what a send that would overflow the pair's context does (context_fit.py)
OVERFLOW_POLICIES = ("drop_oldest", "refuse", "keep_last", "summarise")  # Alt+O cycles in this order
THEMES_DARK_LIGHT = ("textual-dark", "textual-light")
FILE_NAME = "settings.toml"
# what a chat keeps of the settings it was last sent with (storage: chats.settings)
CHAT_FIELDS = ("speculative", "thinking", "temperature", "top_p", "max_tokens", "seed",
               "block_size", "overflow", "keep_turns")


@dataclass(frozen=True)
class Settings:
    theme: str = "textual-dark"
    speculative: bool = True  # the mode of the next message; F2 flips it
    show_accepted: bool = True  # tint accepted drafts: the drafter's green, lookup drafts amber
    thinking: str = "auto"
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 512
    seed: int = -1  # -1 = no seed
    block_size: int = 0  # 0 = the service's default for the pair
    draft_window: int = 0  # context rows the drafter keeps; 0 = the service's default for the pair
    overflow: str = "drop_oldest"  # one of OVERFLOW_POLICIES
    keep_turns: int = 8  # the turns keep_last sends (with the system prompt)
    system_prompt: str = ""  # for new chats
    keymap: dict[str, str] = field(default_factory=dict)  # action id -> keys

    def problems(self) -> list[str]:
        """What is out of range, in words; empty when the settings are usable."""
        problems = []
        if self.thinking not in THINKING_MODES:
            problems.append(f"thinking {self.thinking!r} is not one of {THINKING_MODES}")
        if self.overflow not in OVERFLOW_POLICIES:
            problems.append(f"overflow {self.overflow!r} is not one of {OVERFLOW_POLICIES}")
        if self.keep_turns < 1:
            problems.append(f"keep_turns {self.keep_turns} is not >= 1")
        if not 0.0 <= self.temperature <= 2.0:
            problems.append(f"temperature {self.temperature} is not in [0, 2]")
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p {self.top_p} is not in (0, 1]")
        if self.max_tokens < 1:
            problems.append(f"max_tokens {self.max_tokens} is not >= 1")
        if self.seed < -1:
            problems.append(f"seed {self.seed} is not >= -1 (-1 = none)")
        if not 0 <= self.block_size <= 256:
            problems.append(f"block_size {self.block_size} is not in [0, 256] (0 = default)")
        if self.draft_window < 0:
            problems.append(f"draft_window {self.draft_window} is not >= 0 (0 = default)")
        return problems + check_keymap(self.keymap)

    def sampling(self) -> dict:
        """The request fields these settings set (OpenAI names plus our extensions)."""
        options: dict = {"temperature": self.temperature, "top_p": self.top_p,
                         "max_tokens": self.max_tokens}
        if self.seed >= 0:
            options["seed"] = self.seed
        if self.block_size > 0:
            options["block_size"] = self.block_size
        if self.draft_window > 0:
            options["draft_window"] = self.draft_window
        if self.thinking != "auto":
            options["thinking"] = self.thinking == "on"
        return options


def settings_path() -> Path:
    from dflash_local import paths

    return paths.config_dir_path() / FILE_NAME  # not created until a save (save_settings)


def load_settings(path: Path) -> tuple[Settings, list[str]]:
    """The settings in `path` (defaults if it is missing) and the problems found in it."""
    if not path.is_file():
        return Settings(), []
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        return Settings(), [f"{path}: {exc}; using the defaults"]
    defaults = Settings()
    values, problems = {}, []
    for spec in fields(Settings):
        if spec.name not in raw:
            continue
        value, default = raw[spec.name], getattr(defaults, spec.name)
        if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value) is not type(default) or (spec.name == "keymap" and not _str_map(value)):
            problems.append(f"{path}: {spec.name} = {value!r} is not a {type(default).__name__}")
            continue
        values[spec.name] = value
    settings = replace(defaults, **values)
    bad = settings.problems()
    if bad:
        return defaults, [f"{path}: {problem}; using the defaults" for problem in bad]
    return settings, problems


def save_settings(settings: Settings, path: Path) -> None:
    """Write atomically (a temp file then a rename): a crash leaves the old file or the new."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_suffix(".toml.tmp")
    temp.write_text(dumps(settings), encoding="utf-8")
    os.replace(temp, path)


def dumps(settings: Settings) -> str:
    lines = ["# dflash-chat settings (written by the app; edits are kept)"]
    values = asdict(settings)
    keymap = values.pop("keymap")
    lines += [f"{_key(name)} = {_value(value)}" for name, value in values.items()]
    lines += ["", "[keymap]  # action id = \"keys\" (see F1 for the ids)"]
    lines += [f"{_key(name)} = {_value(keys)}" for name, keys in sorted(keymap.items())]
    return "\n".join(lines) + "\n"


BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r", "\b": "\\b",
           "\f": "\\f"}


def _key(name: str) -> str:
    return name if BARE_KEY.match(name) else _string(name)


def _value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return _string(value)
    raise TypeError(f"settings value {value!r} has no TOML form here")


def _string(text: str) -> str:
    out = []
    for char in text:
        if char in ESCAPES:
            out.append(ESCAPES[char])
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def _str_map(value) -> bool:
    return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())
