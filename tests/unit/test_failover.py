"""Failure handling in the gateway, in-process (fake engines; the Ray versions are in
tests/integration/test_faults.py): a request whose replica dies before its first byte is
retried elsewhere; a stream cut by a dead, hung, stalled or raising replica ends with an error
event and [DONE]; the replica leaves the rotation and comes back by itself after a restart."""

import concurrent.futures as cf

import httpx
import pytest

from gateway.routing.replicas import ReplicaState
from tandem_core.errors import ErrorKind, TandemError
from tests.unit.gateway_server import HeldStreams, complete_outcome, fake_gateway, stream_outcome
from tests.waiting import wait_for

TOKENS = 10
# stall_timeout_s: far above how long a test holds a replica before its fault, and above the
# health-check timeouts the slow-health-check test lives through without a restart.
GATEWAY = {"health_interval_s": 0.2, "stall_timeout_s": 5.0, "unhealthy_after": 2}


def _gateway():
    return fake_gateway({"num_tokens": TOKENS, "token_delay_s": 0.1}, replicas=2, extra={"gateway": GATEWAY})


def _wait_for(cond, timeout: float, what: str) -> float:
    return wait_for(cond, what, timeout=max(timeout, 60), interval=0.02)  # generous: a slow box only waits longer


def _kill(service, replica) -> None:
    """What the channel reader does when Ray reports the actor dead."""
    def die():
        err = TandemError(ErrorKind.ENGINE_DEAD, "the replica serving this request died")
        replica.handle._demux.fail_all(err)
        replica.handle.on_broken(err)
    service.loop.call_soon_threadsafe(die)


def _held(ex, url, victim, engine, n: int) -> HeldStreams:
    return HeldStreams(ex, url, victim.id, lambda: setattr(engine, "stall", True), lambda: len(engine.running), n,
                       TOKENS)


def test_dead_replica_retries_unanswered_requests_and_cuts_streams_with_an_error():
    with _gateway() as (url, service, deployment):
        victim = service.router.pools["fake"].replicas[0]
        old_engine = deployment.engines[victim.id]
        retries = service.metrics.retries.labels("fake")._value.get()
        with cf.ThreadPoolExecutor(12) as ex:
            streams = _held(ex, url, victim, old_engine, 6)
            plain = [ex.submit(complete_outcome, url, TOKENS) for _ in range(6)]
            # those on the survivor finish; those on the victim are held, unanswered
            _wait_for(lambda: sum(f.done() for f in plain) + len(old_engine.running) - streams.held == 6, 30,
                      "the non-streamed requests to be answered or held")
            plain_on_victim = len(old_engine.running) - streams.held
            _kill(service, victim)
            streams.check()
            plain_results = [f.result(timeout=30) for f in plain]
        # nothing had been sent for the non-streamed ones: retried on the survivor, all answered
        assert plain_results == ["ok"] * 6
        assert service.metrics.retries.labels("fake")._value.get() - retries == plain_on_victim
        _wait_for(lambda: victim.state is ReplicaState.HEALTHY, 10, "the replica did not come back")
        assert victim.restarts == 1 and deployment.engines[victim.id] is not old_engine
        # back in rotation: it serves again. Two idle replicas tie, and a tie is broken at random:
        # send until it takes one (40 all elsewhere: 2**-40), every one answered.
        outcomes = []
        while not deployment.engines[victim.id].served and len(outcomes) < 40:
            outcomes.append(stream_outcome(url, TOKENS))
        assert outcomes == ["ok"] * len(outcomes)
        assert len(deployment.engines[victim.id].served) >= 1, f"not served in {len(outcomes)} requests"


@pytest.mark.parametrize("fault", ["hang", "stall", "raise"])
def test_a_failing_engine_is_taken_out_fails_its_requests_and_comes_back(fault):
    with _gateway() as (url, service, deployment):
        victim = service.router.pools["fake"].replicas[0]
        engine = deployment.engines[victim.id]
        with cf.ThreadPoolExecutor(8) as ex:
            streams = _held(ex, url, victim, engine, 6)
            setattr(engine, {"hang": "hang", "stall": "stall", "raise": "broken"}[fault], True)
            # out of rotation: within unhealthy_after checks (timeouts, engine errors), or the stall timeout
            _wait_for(lambda: victim.state is not ReplicaState.HEALTHY or victim.restarts, 30,
                      "the replica to leave the rotation")
            streams.check()
        _wait_for(lambda: victim.state is ReplicaState.HEALTHY, 10, "the replica did not come back")
        assert victim.restarts == 1 and deployment.engines[victim.id] is not engine
        assert [complete_outcome(url, TOKENS) for _ in range(4)] == ["ok"] * 4


def test_a_slow_health_check_takes_a_replica_out_but_not_down():
    """Timeouts alone (the engine still makes progress) only take it out of rotation until it answers."""
    with _gateway() as (url, service, deployment):
        victim = service.router.pools["fake"].replicas[0]
        engine = deployment.engines[victim.id]
        engine.hang = True
        _wait_for(lambda: victim.state is ReplicaState.UNHEALTHY, 3, "never out of rotation")
        engine.hang = False
        _wait_for(lambda: victim.state is ReplicaState.HEALTHY, 3, "never back")
        assert victim.restarts == 0 and deployment.engines[victim.id] is engine


def test_a_restart_refused_for_its_configuration_leaves_the_replica_failed_with_one_line():
    """The replica's engine broke; its restart's engine refuses its configuration (as vLLM would,
    say, after a config change on the node): no retry loop, ``failed`` with the one line."""
    with _gateway() as (url, service, deployment):
        victim = service.router.pools["fake"].replicas[0]
        engine = deployment.engines[victim.id]
        deployment.engine_args["fail"] = "config"  # what every engine made from now on gets
        engine.broken = True
        _wait_for(lambda: victim.state is ReplicaState.FAILED, 30, "the replica to be failed")
        assert victim.last_error == "model 'fake': engine_args.fail: the fake engine refuses its config"
        ready = httpx.get(url + "/ready", timeout=10).json()["models"]["fake"]
        assert ready["ready"]  # the other replica serves
        assert any(r["error"] == victim.last_error for r in ready["replicas"])
        assert complete_outcome(url, TOKENS) == "ok"
