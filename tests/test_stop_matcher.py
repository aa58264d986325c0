"""The stop matcher against the plain definition (the earliest stop string to end in the whole
text; the text before it), over every way a text arrives in deltas; long stop strings too."""

from __future__ import annotations

import random

from dflash_local.service.stop_strings import StopMatcher


def cut_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    ends = [(index + len(stop), -len(stop)) for stop in stops if (index := text.find(stop)) >= 0]
    if not ends:
        return text, False
    end, minus_length = min(ends)
    return text[: end + minus_length], True


def streamed(stops: tuple[str, ...], deltas: list[str]) -> tuple[str, bool]:
    matcher, emitted = StopMatcher(stops), []
    for delta in deltas:
        text, hit = matcher.feed(delta)
        emitted.append(text)
        if hit:
            return "".join(emitted), True
        assert not any(stop in "".join(emitted) for stop in stops)
    return "".join(emitted) + matcher.flush(), False


def test_matches_the_definition_over_random_texts_and_splits():
    rng = random.Random(0)
    for _ in range(3000):
        stops = tuple("".join(rng.choice("ab") for _ in range(rng.randint(1, 4)))
                      for _ in range(rng.randint(1, 3)))
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 14)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(3, len(text) + 1)))
        deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert streamed(stops, deltas) == cut_at_stop(text, stops), (stops, deltas)


def test_long_stop_strings_hold_back_only_what_could_begin_one():
    stop = "x" * 999 + "y"
    matcher = StopMatcher((stop,) * 8)
    assert matcher.feed("ab" + "x" * 500) == ("ab", False)  # the x's may begin the stop
    assert matcher.feed("z") == ("x" * 500 + "z", False)
    text, hit = matcher.feed("x" * 999 + "y")
    assert (text, hit) == ("", True)
