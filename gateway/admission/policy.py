"""Who gets a model's next free replica slot (the choosers then pick which replica).

Three tiers, as llm-d dispatches:
1. **Priority** (vLLM's ``priority``: lower is more urgent, default 0): a more urgent waiter
   always goes first. A waiter that has waited ``promote_after_s`` is promoted above every band
   (oldest first), so nothing starves.
2. **Fairness between tenants** within a band: a virtual token counter per tenant (as AIBrix's
   and the VTC paper's), charged ``cost / weight`` for each request let through; the waiting
   tenant with the smallest counter goes next. A tenant that was idle starts level with the
   least-served active one, so idleness is not banked as credit, and a tenant alone takes every
   slot (work conserving). Chosen over weighted fair queuing's finish tags because a request's
   true cost (its generated tokens) is not known at admission: the counter charges the estimate
   when the request is let through (``router.request_cost``: ``Intake.tokens`` on autoregressive
   models; ``n`` on diffusion ones, the rows of one prompt, a completion's list of prompts counted
   as one) and is never corrected by what it used, so a tenant whose requests stop early is
   charged for the output they could have made; simple to share.
3. **Arrival order** within a tenant.

Pure: no asyncio, no clock of its own (``now`` is passed), so it is tested with a fake clock.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from tandem_core.protocol import DEFAULT_TENANT


@dataclass(eq=False)
class Ticket:
    """One waiter's place: what admission orders by. ``item``: the caller's waiter."""

    item: object
    priority: int = 0
    tenant: str = DEFAULT_TENANT
    weight: float = 1.0
    cost: float = 1.0
    since: float = 0.0
    seq: int = field(default=0)


class Admission:
    def __init__(self, promote_after_s: float | None = 30.0):
        self.promote_after_s = promote_after_s
        self._queues: dict[tuple[int, str], deque[Ticket]] = {}  # (priority, tenant) -> tickets in order
        # tenant -> virtual tokens served (cost / weight); a dict, or the store several gateway
        # processes share (``gateway/admission/shared.py``: its ``get``/``[]=`` read and write it)
        self.counters = {}
        self._seq = itertools.count()
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def push(self, ticket: Ticket, waiting_elsewhere: Iterable[str] = ()) -> Ticket:
        """Queue ``ticket``. ``waiting_elsewhere``: tenants waiting in other gateway processes
        (they count as active for the level a (re)joining tenant starts at)."""
        ticket.seq = next(self._seq)
        self.level(ticket.tenant, waiting_elsewhere)
        self._queues.setdefault((ticket.priority, ticket.tenant), deque()).append(ticket)
        self._n += 1
        return ticket

    def level(self, tenant: str, waiting_elsewhere: Iterable[str] = ()) -> None:
        """A tenant (re)joining the waiters starts level with the least-served active one: no
        credit banked while idle. No-op for a tenant already waiting here."""
        if any(t == tenant for _, t in self._queues):
            return
        active = [self.counters.get(t, 0.0) for t in itertools.chain((t for _, t in self._queues), waiting_elsewhere)
                  if t != tenant]
        floor = min(active) if active else 0.0
        self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)

    def charge(self, tenant: str, cost: float, weight: float) -> None:
        """Count a request let through to ``tenant``'s share."""
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost / weight

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def remove(self, ticket: Ticket) -> None:
        """A waiter that left (cancelled, timed out, failed); no-op if it is not queued."""
        q = self._queues.get((ticket.priority, ticket.tenant))
        if q is not None and ticket in q:
            q.remove(ticket)
            self._n -= 1
            if not q:
                del self._queues[(ticket.priority, ticket.tenant)]

    def peek(self, now: float) -> Ticket | None:
        """The waiter that goes next, without taking it."""
        if not self._n:
            return None
        heads = [q[0] for q in self._queues.values()]
        if self.promote_after_s is not None:
            starving = [t for t in heads if self.promoted(t, now)]
            if starving:
                return min(starving, key=lambda t: t.seq)
        band = min(t.priority for t in heads)
        return min((t for t in heads if t.priority == band),
                   key=lambda t: (self.counters.get(t.tenant, 0.0), t.seq))

    def promoted(self, ticket: Ticket, now: float) -> bool:
        """It waited past ``promote_after_s``: it goes before every band."""
        return self.promote_after_s is not None and now - ticket.since >= self.promote_after_s

    def goes_before_every_waiter(self, priority: int, now: float) -> bool:
        """A new request of ``priority`` would go first: nobody waits, or every waiter is of a
        less urgent band and none is promoted (the fast path: no ticket needed)."""
        if not self._n:
            return True
        head = self.peek(now)
        return head is not None and priority < head.priority and not self.promoted(head, now)

    def pop(self, now: float) -> Ticket | None:
        """Take the waiter that goes next and charge its tenant."""
        ticket = self.peek(now)
        if ticket is not None:
            self.remove(ticket)
            self.charge(ticket.tenant, ticket.cost, ticket.weight)
        return ticket

    def tickets(self) -> list[Ticket]:
        """Every waiting ticket (any order)."""
        return [t for q in self._queues.values() for t in q]

    def queued_by_priority(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for (priority, _), q in self._queues.items():
            out[priority] = out.get(priority, 0) + len(q)
        return out
