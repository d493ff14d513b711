"""Helpers for tests that assert on what a (random) model wrote: they must hold for any output."""

from __future__ import annotations

REPLACEMENT = "\ufffd"


def stop_string_in(text: str, length: int = 3) -> str | None:
    """``length`` characters of ``text`` to use as a stop string, or None if it has none: first
    found after the text's start (so the cut answer is not empty), from its later part, and with
    no U+FFFD (a partial character, which a stream's text holds where the final text may have a
    whole one)."""
    for at in range(max(1, len(text) // 3), len(text) - length + 1):
        stop = text[at:at + length]
        if REPLACEMENT not in stop and not stop.isspace() and text.index(stop) > 0:
            return stop
    return None


def first_with_a_stop_string(answer, tries: int = 20, length: int = 3) -> tuple[int, str, str]:
    """``answer(i)`` -> text for i = 0, 1, ... until one has a stop string: (i, text, stop).
    Fails loudly if none of ``tries`` answers has one."""
    texts = []
    for i in range(tries):
        text = answer(i)
        stop = stop_string_in(text, length)
        if stop is not None:
            return i, text, stop
        texts.append(text)
    raise AssertionError(f"none of {tries} answers had a stop string to take: {texts!r}")
