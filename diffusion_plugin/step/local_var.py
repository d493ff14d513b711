"""``LocalVar``: the step's per-pass settings (the fast mode's GEMMs, attention, experts and
self-conditioning input), read deep inside a family's forward where no argument reaches.

A per-thread variable with ``ContextVar``'s ``get``/``set``/``reset``: a pass sets it, runs, and
resets it, all on the runner's thread. Unlike a ``ContextVar``, ``torch.compile`` traces its
reads (Dynamo cannot trace ``ContextVar.get``: each read broke the compiled trunk into another
graph), guarding on the values it holds, so one compiled trunk serves every step.
"""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

T = TypeVar("T")


class LocalVar(threading.local, Generic[T]):
    def __init__(self, name: str, default: T):
        self.name, self.value = name, default

    def get(self) -> T:
        return self.value

    def set(self, value: T) -> T:
        """Sets ``value``; returns the value before, for ``reset``."""
        old, self.value = self.value, value
        return old

    def reset(self, old: T) -> None:
        self.value = old
