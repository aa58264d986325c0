"""Stop strings across a reply's text deltas: what may be shown, and where the reply ends.

The worker feeds each round's text; a tail that could begin a stop string is held back until
the next round decides it.
"""

from __future__ import annotations


class StopMatcher:
    """Finds stop strings across text deltas, holding back a tail that could begin one.

    Each stop string is a Knuth-Morris-Pratt automaton that reads every character once: the
    work is linear in the text and the stop strings, however long they are.
    """

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(stop for stop in stops if stop)
        self._fallback = [_longest_borders(stop) for stop in self.stops]
        self._matched = [0] * len(self.stops)  # per stop: the longest text suffix that begins it
        self._pending = ""
        self.matched: str | None = None  # the stop string found, once one is

    def feed(self, delta: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was found)."""
        if not self.stops:
            return delta, False
        text = self._pending + delta
        for end, char in enumerate(delta, start=len(self._pending) + 1):
            found = [stop for index, stop in enumerate(self.stops)
                     if self._advance(index, char) == len(stop)]
            if found:  # the earliest stop to end; of those ending together, the longest
                self.matched = max(found, key=len)
                self._pending, self._matched = "", [0] * len(self.stops)
                return text[: end - len(self.matched)], True
        keep = max(self._matched)
        self._pending = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        text, self._pending = self._pending, ""
        return text

    def _advance(self, index: int, char: str) -> int:
        stop, fallback, matched = self.stops[index], self._fallback[index], self._matched[index]
        if matched == len(stop):
            matched = fallback[matched - 1]
        while matched and stop[matched] != char:
            matched = fallback[matched - 1]
        if stop[matched] == char:
            matched += 1
        self._matched[index] = matched
        return matched


def _longest_borders(text: str) -> list[int]:
    """KMP's table: for each prefix of `text`, its longest proper prefix that is also a suffix."""
    borders = [0] * len(text)
    length = 0
    for position in range(1, len(text)):
        while length and text[position] != text[length]:
            length = borders[length - 1]
        if text[position] == text[length]:
            length += 1
        borders[position] = length
    return borders
