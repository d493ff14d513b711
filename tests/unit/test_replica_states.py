"""The replica state machine (``gateway.routing.replicas``): the one place a replica's state changes, the
table of legal moves and what each sets off, the generation counter, and the effects carried out
by the pool's and the supervisor's listeners."""

import pytest

from gateway.routing.replicas import TRANSITIONS, Effect, IllegalMove, Replica, ReplicaState

S = ReplicaState


def _replica(state=S.STARTING) -> Replica:
    return Replica(id="m/0", model="m", handle=None, initial=state)


def test_every_state_can_be_left_and_reached_and_the_table_says_the_rest():
    sources = {a for a, _ in TRANSITIONS}
    targets = {b for _, b in TRANSITIONS}
    assert sources == targets == set(S)
    # What the table decides (the list): restarts count and drop the cache, serving wakes.
    for (a, b), effects in TRANSITIONS.items():
        assert (Effect.RESTART in effects) == (b is S.RESTARTING and a in (S.HEALTHY, S.UNHEALTHY)), (a, b)
        assert (Effect.WAKE in effects) == (b is S.HEALTHY), (a, b)
        assert (Effect.PUBLISH in effects) == (b is S.DRAINING and a is not S.DRAINING), (a, b)
        if b is S.FAILED or (a is S.HEALTHY and b is not S.HEALTHY):
            assert Effect.FAIL_WAITERS in effects, (a, b)  # it stops serving: the queue may be stranded
    assert (S.FAILED, S.HEALTHY) not in TRANSITIONS and (S.DRAINING, S.HEALTHY) not in TRANSITIONS


def test_a_move_not_in_the_table_raises_and_changes_nothing():
    r = _replica(S.FAILED)
    with pytest.raises(IllegalMove, match="failed -> healthy"):
        r.move_to(S.HEALTHY)
    assert r.state is S.FAILED
    with pytest.raises(AttributeError):
        r.state = S.HEALTHY  # only move_to changes it


def test_the_generation_counts_restarts_and_listeners_see_each_move():
    r = _replica()
    seen = []
    r.listeners.append(lambda m: seen.append((m.old, m.new, m.effects)))
    r.move_to(S.PENDING, "no node has 1 GPU free")
    assert r.last_error == "no node has 1 GPU free"
    r.move_to(S.STARTING)
    r.move_to(S.HEALTHY)
    assert (r.generation, r.restarts, r.last_error) == (0, 0, None)
    r.move_to(S.UNHEALTHY, "health check timed out")
    assert r.unhealthy_since > 0 and r.generation == 0  # the same engine
    r.move_to(S.RESTARTING, "unresponsive for 30 s")
    r.move_to(S.RESTARTING, "restart: RuntimeError: boom")  # a failed try: no new generation
    r.move_to(S.HEALTHY)
    assert (r.generation, r.restarts) == (1, 1)
    r.move_to(S.DRAINING)
    assert [(a.value, b.value) for a, b, _ in seen] == [
        ("starting", "pending"), ("pending", "starting"), ("starting", "healthy"), ("healthy", "unhealthy"),
        ("unhealthy", "restarting"), ("restarting", "restarting"), ("restarting", "healthy"),
        ("healthy", "draining")]
    assert seen[4][2] == Effect.RESTART | Effect.DROP_CACHE | Effect.FAIL_WAITERS
