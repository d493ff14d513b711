"""Failure handling in the gateway, in-process (fake engines; the Ray versions are in
tests/integration/test_faults.py): a request whose replica dies before its first byte is
retried elsewhere; a stream cut by a dead, hung, stalled or raising replica ends with an error
event and [DONE]; the replica leaves the rotation and comes back by itself after a restart."""

import concurrent.futures as cf
import time

import pytest

from gateway.errors import ErrorKind, TandemError
from gateway.replicas import ReplicaState
from tests.unit.gateway_server import complete_outcome, fake_gateway, stream_outcome

TOKENS = 10
GATEWAY = {"health_interval_s": 0.2, "stall_timeout_s": 1.0, "unhealthy_after": 2}


def _gateway():
    return fake_gateway({"num_tokens": TOKENS, "token_delay_s": 0.1}, replicas=2, extra={"gateway": GATEWAY})


def _wait_for(cond, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, what
        time.sleep(0.02)
    return time.monotonic() - t0


def _kill(service, replica) -> None:
    """What the channel reader does when Ray reports the actor dead."""
    def die():
        err = TandemError(ErrorKind.ENGINE_DEAD, "the replica serving this request died")
        replica.handle._demux.fail_all(err)
        replica.handle.on_broken(err)
    service.loop.call_soon_threadsafe(die)


def test_dead_replica_retries_unanswered_requests_and_cuts_streams_with_an_error():
    with _gateway() as (url, service, deployment):
        victim, survivor = service.router.pools["fake"].replicas
        old_engine = deployment.engines[victim.id]
        with cf.ThreadPoolExecutor(12) as ex:
            plain = [ex.submit(complete_outcome, url, TOKENS) for _ in range(6)]
            streams = [ex.submit(stream_outcome, url, TOKENS) for _ in range(6)]
            _wait_for(lambda: len(old_engine.running) >= 4, 5, "requests never reached the victim")
            time.sleep(0.35)  # streams have sent tokens; non-streamed answers (1 s) are not ready
            _kill(service, victim)
            plain_results = [f.result(timeout=30) for f in plain]
            stream_results = [f.result(timeout=30) for f in streams]
        # nothing had been sent for the non-streamed ones: retried on the survivor, all answered
        assert plain_results == ["ok"] * 6
        assert service.metrics.retries.labels("fake")._value.get() >= 1
        # streams already under way on the victim end with an error event, never silence
        assert set(stream_results) <= {"ok", "error"} and "error" in stream_results, stream_results
        _wait_for(lambda: victim.state is ReplicaState.HEALTHY, 10, "the replica did not come back")
        assert victim.restarts == 1 and deployment.engines[victim.id] is not old_engine
        assert [stream_outcome(url, TOKENS) for _ in range(4)] == ["ok"] * 4
        assert len(deployment.engines[victim.id].served) >= 1  # back in rotation


@pytest.mark.parametrize("fault", ["hang", "stall", "raise"])
def test_a_failing_engine_is_taken_out_fails_its_requests_and_comes_back(fault):
    with _gateway() as (url, service, deployment):
        victim, survivor = service.router.pools["fake"].replicas
        engine = deployment.engines[victim.id]
        with cf.ThreadPoolExecutor(8) as ex:
            streams = [ex.submit(stream_outcome, url, TOKENS) for _ in range(6)]
            other = deployment.engines[survivor.id]
            _wait_for(lambda: len(engine.running) + len(other.running) == 6, 5, "requests never reached the engines")
            on_victim = len(engine.running)
            setattr(engine, {"hang": "hang", "stall": "stall", "raise": "broken"}[fault], True)
            # out of rotation: within unhealthy_after checks (timeouts, engine errors), or the stall timeout
            limit = GATEWAY["stall_timeout_s"] + 3 * GATEWAY["health_interval_s"] + 1
            _wait_for(lambda: victim.state is not ReplicaState.HEALTHY or victim.restarts, limit,
                      "the replica stayed in rotation")
            results = [f.result(timeout=30) for f in streams]
        assert results.count("error") == on_victim and results.count("ok") == 6 - on_victim, results
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
