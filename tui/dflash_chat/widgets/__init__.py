"""The app's widgets. Each keeps its styles in a .tcss file beside it (loaded as DEFAULT_CSS,
so screens and the user's theme can override them)."""

from pathlib import Path


def widget_css(module_file: str) -> str:
    """The .tcss beside a widget module."""
    return Path(module_file).with_suffix(".tcss").read_text(encoding="utf-8")
