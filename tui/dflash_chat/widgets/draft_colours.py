"""The accepted drafts' colours on a reply's *rendered* Markdown.

The reply's source text knows, per character, whether an accepted draft (the drafter's, or a
prompt-lookup draft) made it (`accepted_text`). Each rendered block of a Markdown widget knows
the source lines it came from; its rendered text is those lines less the markup (fences, `**`,
`#`, list bullets), so walking both in order pairs each rendered character with its source
character, and the rendered text takes that character's colour. Rendering is never replaced.
"""

from __future__ import annotations

from typing import ClassVar
from weakref import WeakKeyDictionary

from rich.text import Text
from textual.content import Content
from textual.message import Message
from textual.widgets import Markdown
from textual.widgets.markdown import MarkdownBlock, MarkdownFence

# A tint behind the text, from the theme's own colours (resolved when painted, so a theme change
# follows): the text keeps its colour, syntax colours in code included, and reads on any theme.
DRAFT_STYLE = "on $success 20%"
LOOKUP_STYLE = "on $accent 20%"  # accepted prompt-lookup drafts: read from the context, not drafted
MATCH_WINDOW = 48  # how far past markup (a link's URL, a fence's info) a character is looked for


def accepted_text(text: str, rounds: list[list[int]]) -> Text:
    """`text` with the accepted drafts styled; rounds are [chars, accepted, committed] plus,
    from services that say it, the exact count of characters the accepted drafts made and how
    many of those (the last) a prompt-lookup draft made."""
    styled = Text()
    position = 0
    for chars, accepted, committed, *exact in rounds:
        piece = text[position:position + chars]
        position += chars
        if exact and exact[0] is not None:
            split = min(exact[0], len(piece))
        else:  # an older record or another server: share the round's characters by tokens
            split = round(len(piece) * accepted / committed) if committed else 0
        # the lookup draft's characters follow the drafter's; a piece a stop string cut keeps its start
        has_lookup = len(exact) > 1 and exact[0] is not None
        own = min(exact[0] - (exact[1] or 0), split) if has_lookup else split
        styled.append(piece[:own], style=DRAFT_STYLE)
        styled.append(piece[own:split], style=LOOKUP_STYLE)
        styled.append(piece[split:])
    styled.append(text[position:])
    return styled


def char_styles(text: str, rounds: list[list[int]]) -> list[str | None]:
    """The draft style of each character of `text` (None: the target's own token)."""
    styles: list[str | None] = [None] * len(text)
    for span in accepted_text(text, rounds).spans:
        styles[span.start:span.end] = [str(span.style)] * (span.end - span.start)
    return styles


def align(rendered: str, source: str) -> list[int | None]:
    """For each rendered character, the index of the source character it shows (or None)."""
    pairs: list[int | None] = []
    position = 0
    for char in rendered:
        if char.isspace():  # wrapped or collapsed whitespace: any source whitespace will do
            found = next((i for i in range(position, min(len(source), position + MATCH_WINDOW))
                          if source[i].isspace()), -1)
        else:
            found = source.find(char, position, position + MATCH_WINDOW)
        pairs.append(found if found >= 0 else None)
        if found >= 0:
            position = found + 1
    return pairs


def coloured(content: Content, source: str, styles: list[str | None], offset: int) -> Content:
    """`content` (a block's rendered text) with the styles of the source characters it shows."""
    runs: list[tuple[str, int, int]] = []
    for index, source_index in enumerate(align(content.plain, source)):
        style = styles[offset + source_index] if source_index is not None else None
        if style is None:
            continue
        if runs and runs[-1][0] == style and runs[-1][2] == index:
            runs[-1] = (style, runs[-1][1], index + 1)
        else:
            runs.append((style, index, index + 1))
    for style, start, end in runs:
        content = content.stylize(style, start, end)
    return content


def colour_markdown(markdown: Markdown, text: str, rounds: list[list[int]],
                    painted: WeakKeyDictionary | None = None) -> None:
    """Colour the accepted drafts on every rendered block of `markdown` (showing `text`).
    `painted` remembers what each block was given: a block still showing it is skipped (a
    streaming reply changes only its last blocks between paints)."""
    painted = WeakKeyDictionary() if painted is None else painted
    # the block's rendered text (Textual keeps no public copy); nothing new: nothing computed
    unpainted = [block for block in markdown.query(MarkdownBlock)
                 if painted.get(block) is not block._content]
    if not unpainted:
        return
    styles = char_styles(text, rounds)
    line_starts = [0]
    for line in text.splitlines(keepends=True):
        line_starts.append(line_starts[-1] + len(line))
    for block in unpainted:
        content = block._content
        first, last = block.source_range
        if not content.plain:  # nothing to paint on it until its content changes
            painted[block] = content
            continue
        if last <= first or last >= len(line_starts):
            continue
        start, end = line_starts[first], line_starts[last]
        if isinstance(block, MarkdownFence):  # the code starts after the ``` line
            start = text.find("\n", start, end) + 1 or start
        painted[block] = coloured(content, text[start:end], styles, start)
        block.set_content(painted[block])


class PaintedFence(MarkdownFence):
    """A code block that says when a style change (the theme, its first styles) highlighted it
    again: that drops the colours painted on it."""

    class Rehighlighted(Message):
        pass

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self.post_message(self.Rehighlighted())


class PaintedMarkdown(Markdown):
    """A reply's Markdown: its code blocks are PaintedFences."""

    BLOCKS: ClassVar[dict[str, type[MarkdownBlock]]] = {
        **Markdown.BLOCKS, "fence": PaintedFence, "code_block": PaintedFence}
