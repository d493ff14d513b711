"""Per-key rate limits shared by the gateway processes of one host (``gateway/processes.py``).

A shared store, not a split of each key's budget: with a split (each of N processes allows
1/N of a key's minute), a key whose requests land unevenly on the processes is refused while
it still has budget, and the acceptance is exact: the N+1-th request in the window is refused,
whichever process takes it, and none before it.

The store is a small file the parent creates and every gateway process maps in memory: two
doubles (tokens left, last refill) per bucket, a request bucket and a token bucket per key, in
the order ``resolve_keys`` gives (the same in every process: same config, same environment).
A check takes an exclusive ``flock`` on the file, reads the bucket, refills it, takes or not,
writes it back, unlocks: a few microseconds, no hop to another process, nothing on the event
loop that can wait (the lock is held for those few instructions only). A process killed while
holding the lock releases it (the kernel drops a dead process's flocks), unlike a semaphore.
The clock is ``time.monotonic`` (CLOCK_MONOTONIC: one clock for every process of a host).

Across hosts (``tandem serve --attach`` on other nodes) each host has its own store: a key's
limit holds per host. See the README ("Several gateway processes").
"""

from __future__ import annotations

import fcntl
import math
import mmap
import os
import struct
from contextlib import contextmanager

from gateway.admission.keys import RateLimiter, TokenBucket, resolve_keys
from tandem_core.config import TandemConfig

SLOT = struct.calcsize("dd")


def create_shared_limits(config: TandemConfig, workdir: str) -> str | None:
    """The store's file (every bucket unset: full), or None when no key has a limit."""
    if not config.auth.enabled:
        return None
    keys = resolve_keys(config.auth, base_dir=config.config_dir)
    if not any(k.requests_per_minute is not None or k.tokens_per_minute is not None for k in keys):
        return None
    path = os.path.join(workdir, "rate-limits")
    with open(path, "wb") as f:
        f.write(struct.pack("dd", math.nan, math.nan) * (2 * len(keys)))
    return path


class SharedStore:
    """The mapped file and its lock (one open file per process: flock excludes between them)."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_RDWR)
        self.map = mmap.mmap(self.fd, 0)
        self.values = memoryview(self.map).cast("d")

    @contextmanager
    def locked(self):
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)


class SharedTokenBucket(TokenBucket):
    """A ``TokenBucket`` whose state lives in the store, read and written under its lock."""

    def __init__(self, capacity: float, refill_per_s: float, store: SharedStore, slot: int):
        super().__init__(capacity, refill_per_s)
        self.store = store
        self.slot = slot

    def _load(self) -> None:
        tokens, last = self.store.values[2 * self.slot], self.store.values[2 * self.slot + 1]
        self.tokens = float(self.capacity) if math.isnan(tokens) else tokens
        self._last = None if math.isnan(last) else last

    def _save(self) -> None:
        self.store.values[2 * self.slot] = self.tokens
        self.store.values[2 * self.slot + 1] = math.nan if self._last is None else self._last

    def try_take(self, amount: float, now: float) -> float:
        with self.store.locked():
            self._load()
            wait = super().try_take(amount, now)
            self._save()
        return wait

    def give_back(self, amount: float) -> None:
        with self.store.locked():
            self._load()
            super().give_back(amount)
            self._save()


def share(limiter: RateLimiter, path: str) -> None:
    """Move ``limiter``'s buckets into the store at ``path`` (key i: slots 2i and 2i+1)."""
    store = SharedStore(path)
    limiter.replace_buckets(lambda i, kind, capacity, refill: SharedTokenBucket(
        capacity, refill, store, 2 * i + (0 if kind == "requests" else 1)))
