"""Admission shared by the gateway processes of one host (``gateway.processes: N``): a model's
slots, its tenants' fair-share counters and who waits at the head of each process's queue live
in one store, so priority and weighted shares hold across the processes, not per process.

Without it each process would admit up to ``max_in_flight_per_replica`` on every replica by
itself (N times the capacity, the engines queueing the rest first come, first served), and a
tenant whose connections landed on one process would get that process's slots whatever its
weight. With it:
- **Slots** are counted per model across processes: a request is admitted only while the
  model's requests in flight, all processes together, are under ``max_in_flight_per_replica``
  x its healthy replicas (less the reserved slots for priority > 0). Which replica takes it
  stays each process's choice (``gateway/routing/choosers.py``, weighing what the others put there).
- **Fair-share counters** (``gateway/admission/policy.py``'s virtual token counters) are one per
  tenant per model, charged by whichever process admits the request.
- **Heads**: each process publishes the priority and tenant of the waiter it would admit next.
  A process admits its head only if no other process's head goes before it (more urgent, or
  the same priority and a tenant with a smaller counter); a promoted (starving) head goes first.

A process whose queue is not empty re-checks every ``POLL_S`` (a slot freed by another process
is seen then): the cost of a hand-off between processes is at most that, and nothing is polled
while nobody waits. The store is a file every process maps in memory, locked with ``flock`` for
the few instructions of a check (as ``gateway/admission/shared_limits.py``); each process has its own
row of counts, which a replacement process (same index) clears when it starts: the requests of
a process that died died with it.
"""

from __future__ import annotations

import math
import os
import struct

from gateway.admission.keys import resolve_keys
from gateway.admission.shared_limits import SharedStore
from tandem_core.config import TandemConfig
from tandem_core.protocol import DEFAULT_TENANT

POLL_S = 0.01
PROMOTED = -1e18  # a promoted head's published priority: before every band


def tenants_of(config: TandemConfig) -> list[str]:
    """The tenants admission can see, in the same order in every process: the anonymous tenant
    (requests without auth), then each configured key's tenant."""
    names = [DEFAULT_TENANT]
    if config.auth.enabled:
        for k in resolve_keys(config.auth, base_dir=config.config_dir):
            if k.tenant_name not in names:
                names.append(k.tenant_name)
    return names


def _row(processes: int, tenants: int) -> int:
    """Doubles per model: held[p], head priority[p], head tenant[p], counter[t]."""
    return 3 * processes + tenants


def create_shared_admission(config: TandemConfig, workdir: str) -> str | None:
    """The store's file (nobody holding, nobody waiting, counters at 0), or None with one process."""
    if config.gateway.processes < 2:
        return None
    path = os.path.join(workdir, "admission")
    create_store(path, len(config.models), config.gateway.processes, len(tenants_of(config)))
    return path


def create_store(path: str, models: int, processes: int, tenants: int) -> None:
    blank = [0.0] * processes + [math.nan] * (2 * processes) + [0.0] * tenants
    with open(path, "wb") as f:
        f.write(struct.pack(f"{len(blank)}d", *blank) * models)


class SharedShares:
    """One model's part of the store, seen from process ``me`` (``ModelPool.share`` takes it)."""

    def __init__(self, store: SharedStore, model_index: int, me: int, processes: int, tenants: list[str]):
        self.store = store
        self.me = me
        self.n = processes
        self.tenants = {name: i for i, name in enumerate(tenants)}
        self.names = tenants
        self._base = model_index * _row(processes, len(tenants))
        self.counters = _Counters(self)
        self.locked = store.locked

    # -- layout ------------------------------------------------------------------------------------
    def _held(self, p: int) -> int:
        return self._base + p

    def _head(self, p: int) -> int:
        return self._base + self.n + 2 * p

    def _counter(self, t: int) -> int:
        return self._base + 3 * self.n + t

    # -- called with the lock held ---------------------------------------------------------------
    def held(self) -> float:
        """The model's requests in flight, every process together."""
        v = self.store.values
        return sum(v[self._held(p)] for p in range(self.n))

    def take(self) -> None:
        self.store.values[self._held(self.me)] += 1

    def publish_head(self, priority: float | None, tenant: str | None) -> None:
        """The waiter this process would admit next (None: nobody waits here)."""
        v = self.store.values
        i = self._head(self.me)
        if priority is None:
            v[i] = v[i + 1] = math.nan
        else:
            v[i], v[i + 1] = float(priority), float(self.tenants.get(tenant, 0))

    def first_elsewhere(self) -> tuple[float, float] | None:
        """The (priority, counter) of the head that goes first among the other processes'."""
        v = self.store.values
        best = None
        for p in range(self.n):
            if p == self.me or math.isnan(v[self._head(p)]):
                continue
            key = (v[self._head(p)], v[self._counter(int(v[self._head(p) + 1]))])
            if best is None or key < best:
                best = key
        return best

    def tenants_waiting_elsewhere(self) -> list[str]:
        v = self.store.values
        return [self.names[int(v[self._head(p) + 1])] for p in range(self.n)
                if p != self.me and not math.isnan(v[self._head(p)])]

    # -- locking itself ----------------------------------------------------------------------------
    def give(self) -> None:
        with self.store.locked():
            self.store.values[self._held(self.me)] -= 1

    def clear_mine(self) -> None:
        """A (replacement) process starts: it holds nothing and nobody waits on it."""
        with self.store.locked():
            self.store.values[self._held(self.me)] = 0.0
            self.publish_head(None, None)


class _Counters:
    """The tenants' virtual token counters in the store (``Admission`` reads and writes them
    like a dict; a tenant unknown to the store counts as the anonymous one)."""

    def __init__(self, shares: SharedShares):
        self.shares = shares

    def _index(self, tenant: str) -> int:
        return self.shares._counter(self.shares.tenants.get(tenant, 0))

    def get(self, tenant: str, default: float = 0.0) -> float:
        return self.shares.store.values[self._index(tenant)]

    def __setitem__(self, tenant: str, value: float) -> None:
        self.shares.store.values[self._index(tenant)] = value


def share_admission(router, config: TandemConfig, path: str, me: int) -> None:
    """Give each of ``router``'s pools its part of the store at ``path`` (process ``me``)."""
    store = SharedStore(path)
    tenants = tenants_of(config)
    for i, m in enumerate(config.models):
        shares = SharedShares(store, i, me, config.gateway.processes, tenants)
        shares.clear_mine()
        router.pools[m.name].share(shares)
