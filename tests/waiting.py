"""Waiting on an observable condition, never on "it has happened by now".

Every wait polls a condition with a generous deadline and fails loudly, saying what did not
happen and the last value seen. Timing is never asserted here: a slow CI box only makes a wait
longer, never makes a test fail; a condition that never comes fails at the deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

# Generous on purpose: a 2-core CI box running Ray and vLLM can be 10x slower than a laptop.
DEFAULT_TIMEOUT_S = 60.0


def wait_for(cond: Callable[[], Any], what: str, timeout: float = DEFAULT_TIMEOUT_S, interval: float = 0.05) -> float:
    """Poll ``cond`` until it is truthy; return the seconds it took. Raises AssertionError naming
    ``what`` (and the last value) after ``timeout`` seconds."""
    t0 = time.monotonic()
    while not _done(cond, t0, what, timeout):
        time.sleep(interval)  # a poll interval, not a synchronisation point
    return time.monotonic() - t0


async def async_wait_for(cond: Callable[[], Any], what: str, timeout: float = DEFAULT_TIMEOUT_S,
                         interval: float = 0.02) -> float:
    """``wait_for`` inside an event loop (``cond`` is a plain, quick callable)."""
    t0 = time.monotonic()
    while not _done(cond, t0, what, timeout):
        await asyncio.sleep(interval)  # a poll interval, not a synchronisation point
    return time.monotonic() - t0


def _done(cond: Callable[[], Any], t0: float, what: str, timeout: float) -> bool:
    value = cond()
    if value:
        return True
    if time.monotonic() - t0 > timeout:
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for: {what} (last value: {value!r})")
    return False
