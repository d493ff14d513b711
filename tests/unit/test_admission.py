"""Admission (gateway/admission/policy.py), alone with a fake clock: priority bands, weighted fair shares
between tenants (a virtual token counter), arrival order within a tenant, promotion of a waiter
that waited too long."""

from gateway.admission.policy import Admission, Ticket


def _push(a: Admission, name: str, priority: int = 0, tenant: str = "t", weight: float = 1.0, since: float = 0.0,
          cost: float = 1.0) -> Ticket:
    return a.push(Ticket(name, priority, tenant, weight, cost, since))


def _drain(a: Admission, now: float = 0.0) -> list[str]:
    out = []
    while (t := a.pop(now)) is not None:
        out.append(t.item)
    return out


def test_more_urgent_first_then_arrival():
    a = Admission()
    for name, priority in (("bulk1", 10), ("std1", 0), ("urgent", -5), ("bulk2", 10), ("std2", 0)):
        _push(a, name, priority)
    assert _drain(a) == ["urgent", "std1", "std2", "bulk1", "bulk2"]


def test_weights_share_the_slots_while_both_wait_and_a_tenant_alone_takes_all():
    a = Admission()
    for i in range(40):
        _push(a, f"a{i}", tenant="a", weight=1)
        _push(a, f"b{i}", tenant="b", weight=3)
    first = [a.pop(0.0).item[0] for _ in range(40)]
    assert first.count("b") == 30 and first.count("a") == 10
    rest = _drain(a)
    assert all(x.startswith("a") for x in rest[-20:])  # b ran out: a alone takes every slot
    alone = Admission()
    for i in range(5):
        _push(alone, f"a{i}", tenant="a", weight=1)
    assert _drain(alone) == [f"a{i}" for i in range(5)]


def test_an_idle_tenant_banks_no_credit():
    a = Admission()
    for i in range(30):  # b is served alone for a while
        _push(a, f"b{i}", tenant="b")
    _drain(a)
    for i in range(10):
        _push(a, f"b{i}", tenant="b")
        _push(a, f"a{i}", tenant="a")
    order = [a.pop(0.0).item[0] for _ in range(10)]
    assert order.count("a") in (5, 6)  # a joins level with b, not 30 requests ahead


def test_a_waiter_past_promote_after_goes_first():
    a = Admission(promote_after_s=30)
    _push(a, "old-bulk", priority=10, since=0.0)
    _push(a, "new-urgent", priority=-1, since=25.0)
    assert a.peek(29.0).item == "new-urgent"
    assert a.peek(30.0).item == "old-bulk" and a.promoted(a.peek(30.0), 30.0)
    assert _drain(a, 30.0) == ["old-bulk", "new-urgent"]


def test_remove_and_the_fast_path():
    a = Admission()
    assert a.goes_before_every_waiter(0, 0.0)
    t = _push(a, "bulk", priority=10)
    assert a.goes_before_every_waiter(0, 0.0) and not a.goes_before_every_waiter(10, 0.0)
    a.remove(t)
    a.remove(t)  # twice: no-op
    assert len(a) == 0 and a.pop(0.0) is None
    _push(a, "x", priority=3)
    _push(a, "y", priority=-2)
    assert a.queued_by_priority() == {3: 1, -2: 1}
