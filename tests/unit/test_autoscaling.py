"""Autoscaling: the decision (pure, a fake clock), the config's checks, and the supervisor with
in-process fake engines: load adds replicas, idleness removes them down to the minimum, and a
replica being removed is drained (no new request, its requests finish) before it goes. The Ray
versions (a cluster, pending placement) are in tests/integration/test_autoscaling.py."""

import asyncio
import concurrent.futures as cf
import json
import os

import httpx
import pytest

from gateway.config import ConfigError, parse_config
from gateway.fleet.autoscaler import Autoscaler
from gateway.fleet.scaling import _removal_order
from gateway.fleet.views import replica_counts
from gateway.routing.replicas import Replica, ReplicaState
from tandem_core.config import AutoscalingConfig
from tandem_core.protocol import Role
from tests.unit.gateway_server import HeldStreams, fake_gateway, stream_outcome
from tests.waiting import wait_for

TOKENS = 6


def _scaler(initial: int = 1, **kw) -> Autoscaler:
    cfg = {"min_replicas": 1, "max_replicas": 4, "target_in_flight_per_replica": 2, "scale_up_window_s": 10,
           "scale_down_window_s": 60, **kw}
    return Autoscaler(AutoscalingConfig(**cfg), initial)


# -- the decision ---------------------------------------------------------------------------------

def test_scales_up_to_load_over_target_once_the_load_stayed_above_for_the_window():
    s = _scaler()
    assert s.observe(0, 7) is None  # above 2 x 1: the window starts
    assert s.observe(9.9, 7) is None
    d = s.observe(10, 7)
    assert (d.previous, d.desired, d.direction) == (1, 4, "up")  # ceil(7 / 2) = 4, at once
    assert s.desired == 4


def test_scale_up_is_capped_at_max_and_a_dip_restarts_the_window():
    s = _scaler()
    s.observe(0, 50)
    assert s.observe(5, 2) is None  # back at the target: the window is gone
    assert s.observe(6, 50) is None
    assert s.observe(15.9, 50) is None
    assert s.observe(16, 50).desired == 4  # max_replicas
    assert s.observe(100, 50) is None  # at max: nothing more to do


def test_no_up_window_scales_at_the_first_sample_above_target():
    s = _scaler(scale_up_window_s=0)
    assert s.observe(0, 2) is None  # at the target, not above
    assert s.observe(0.1, 3).desired == 2


def test_scales_down_one_step_per_idle_window_never_below_min():
    s = _scaler(initial=3, min_replicas=2)
    assert s.observe(0, 0) is None
    assert s.observe(59, 0) is None
    assert s.observe(60, 0).desired == 2  # one step
    assert s.observe(61, 0) is None  # at min: stays
    assert s.observe(1000, 0) is None
    assert s.desired == 2


def test_scale_down_waits_until_the_load_fits_one_replica_fewer():
    s = _scaler(initial=3)
    s.observe(0, 5)  # 5 > 2 x 2: three replicas are needed
    assert s.observe(100, 5) is None
    s.observe(100, 4)  # fits two at the target: the idle window starts
    assert s.observe(159, 4) is None
    assert s.observe(160, 4).desired == 2
    assert s.observe(161, 0) is None  # the next step waits a whole window again
    assert s.observe(220, 0) is None
    assert s.observe(221, 0).desired == 1


def test_initial_count_is_kept_within_min_and_max():
    assert _scaler(initial=9).desired == 4
    assert _scaler(initial=1, min_replicas=2).desired == 2


# -- the config -----------------------------------------------------------------------------------

MODEL = {"name": "m", "kind": "autoregressive", "source": "none"}


def _config(model: dict, **top) -> object:
    return parse_config({"models": [{**MODEL, **model}], **top})


def test_config_starts_at_min_replicas_and_takes_replicas_as_the_initial_count():
    assert _config({"autoscaling": {"min_replicas": 2, "max_replicas": 5}}).models[0].replicas == 2
    assert _config({"replicas": 3, "autoscaling": {"min_replicas": 2, "max_replicas": 5}}).models[0].replicas == 3
    assert _config({"replicas": 3}).models[0].autoscaling is None  # absent: fixed, as always
    diffusion = {"kind": "diffusion", "autoscaling": {"max_replicas": 2}}
    assert _config(diffusion).models[0].autoscaling.max_replicas == 2  # the unit is a replica: same


@pytest.mark.parametrize(("model", "top", "says"), [
    ({"autoscaling": {"min_replicas": 3, "max_replicas": 2}}, {}, "models.0.autoscaling: min_replicas"),
    ({"autoscaling": {"min_replicas": 0, "max_replicas": 2}}, {}, "models.0.autoscaling.min_replicas"),
    ({"autoscaling": {"min_replicas": 1}}, {}, "models.0.autoscaling.max_replicas: Field required"),
    ({"autoscaling": {"max_replicas": 2, "target_in_flight_per_replica": 0}}, {},
     "models.0.autoscaling.target_in_flight_per_replica"),
    ({"replicas": 4, "autoscaling": {"max_replicas": 2}}, {}, "replicas (4) is the initial count"),
    ({"autoscaling": {"max_replicas": 2, "surprise": 1}}, {}, "models.0.autoscaling.surprise"),
])
def test_config_refusals_name_the_field(model, top, says):
    with pytest.raises(ConfigError) as e:
        _config(model, **top)
    assert says in str(e.value), str(e.value)


# -- which replica goes -----------------------------------------------------------------------------

def test_removal_prefers_a_replica_that_serves_nothing_then_the_least_loaded_then_the_newest():
    def rep(i: int, state: ReplicaState, outstanding: int = 0) -> Replica:
        return Replica(id=f"m/{i}", model="m", handle=None, initial=state, outstanding=outstanding)

    busy, light, lighter_old, pending = (rep(0, ReplicaState.HEALTHY, 3), rep(1, ReplicaState.HEALTHY, 1),
                                         rep(2, ReplicaState.HEALTHY, 0), rep(3, ReplicaState.PENDING))
    assert min([busy, light, lighter_old, pending], key=_removal_order) is pending
    newer = rep(4, ReplicaState.HEALTHY, 0)
    assert min([busy, light, lighter_old, newer], key=_removal_order) is newer


# -- the supervisor, in-process ---------------------------------------------------------------------

def _autoscaled(autoscaling: dict, replicas: int | None = None, gateway: dict | None = None, **engine):
    fields = {"autoscaling": {"target_in_flight_per_replica": 1, "interval_s": 0.02, **autoscaling}}
    if replicas is not None:
        fields["replicas"] = replicas
    return fake_gateway({"num_tokens": TOKENS, "token_delay_s": 0.05, **engine},
                        extra={"model_fields": fields, "gateway": gateway or {}})


def _run(service, coro, timeout: float = 30):
    return asyncio.run_coroutine_threadsafe(coro, service.loop).result(timeout)


def _on_loop(service, fn):
    """``fn()`` on the service's event loop (the pool's state is the loop's), its result here."""
    async def call():
        return fn()
    return _run(service, call())


def test_load_scales_up_to_max_and_idleness_back_to_min_with_no_request_lost(tmp_path):
    """Held streams keep the load up (every engine, the new ones too, emits nothing while the
    control file holds this process; health checks pass): the model grows to max_replicas; once
    they finish it shrinks, one step at a time, to min_replicas."""
    control = tmp_path / "control.json"
    control.write_text(json.dumps({str(os.getpid()): "stall"}))
    with _autoscaled({"min_replicas": 1, "max_replicas": 3, "scale_up_window_s": 0, "scale_down_window_s": 0},
                     control_file=str(control)) as (url, service, deployment):
        pool = service.router.pools["fake"]
        with cf.ThreadPoolExecutor(4) as ex:
            futures = [ex.submit(stream_outcome, url, TOKENS, timeout=120) for _ in range(4)]
            wait_for(lambda: sum(len(e.running) for e in deployment.engines.values()) == 4,
                     "every stream to reach an engine")
            wait_for(lambda: len(pool.healthy()) == 3, "the model to scale up to max_replicas (3)")
            assert len(pool.replicas) == 3  # never above max
            scaling = httpx.get(url + "/admin/replicas", timeout=30).json()["models"]["fake"]
            assert scaling["desired"] == 3 and scaling["running"] == 3, scaling
            control.write_text("{}")
            assert [f.result(timeout=120) for f in futures] == ["ok"] * 4
        wait_for(lambda: len(pool.replicas) == 1, "the model to scale back down to min_replicas (1)")
        assert len(deployment.removed) == 2 and not any(e.aborted for e in deployment.engines.values())
        m = service.metrics
        assert m.scale_events.labels("fake", "down")._value.get() == 2
        assert m.scale_events.labels("fake", "up")._value.get() >= 1
        assert _on_loop(service, lambda: replica_counts(pool)) == {"desired": 1, "running": 1, "pending": 0,
                                                                   "draining": 0}


def _drain_setup(drain_timeout_s: float):
    # windows: the autoscaler never decides during the test; the test drains a replica itself.
    return _autoscaled({"min_replicas": 1, "max_replicas": 2, "scale_up_window_s": 3600,
                        "scale_down_window_s": 3600}, replicas=2,
                       gateway={"drain_timeout_s": drain_timeout_s})


def test_a_draining_replica_takes_no_new_request_and_its_requests_finish_before_it_goes():
    """Also as the owner of replicas other gateway processes share: the drain is published, and it
    ends when the replica itself counts no request in flight (every process's)."""
    with _drain_setup(drain_timeout_s=600) as (url, service, deployment):
        deployment.role = Role.OWNER
        pool = service.router.pools["fake"]
        victim, survivor = pool.replicas
        engine = deployment.engines[victim.id]
        with cf.ThreadPoolExecutor(8) as ex:
            held = HeldStreams(ex, url, victim.id, lambda: setattr(engine, "stall", True),
                               lambda: len(engine.running), 6, TOKENS)
            assert held.held >= 1, "p2c over two replicas puts streams on both"
            drained = asyncio.run_coroutine_threadsafe(service.supervisor.scaling.drain_and_remove(victim), service.loop)
            wait_for(lambda: victim.state is ReplicaState.DRAINING, "the victim to be draining")
            assert deployment.tables["fake"] == {victim.id: "draining", survivor.id: "serving"}
            served = {}
            assert stream_outcome(url, TOKENS, served=served) == "ok"
            assert served["replica"] == survivor.id  # no new request reaches a draining replica
            assert victim in pool.replicas and not drained.done()  # it waits for its requests
            engine.stall = False
            # every stream completes, the victim's held ones included
            assert [f.result(timeout=120) for f in held.futures] == ["ok"] * 6
            drained.result(timeout=60)
        assert pool.replicas == [survivor] and deployment.removed == [victim.id]
        assert engine.aborted == []
        assert deployment.tables["fake"] == {survivor.id: "serving"}


def test_an_attached_gateway_process_follows_the_owners_replica_table():
    """What another gateway process does with the table the owner publishes: it serves the
    listed replicas, sends nothing to a draining one, and drops one no longer listed."""
    from gateway.serving.service import Service
    from tests.waiting import async_wait_for
    from workers.fake_engine import FakeDeployment

    async def main():
        config = parse_config({"gateway": {"health_interval_s": 0.2}, "models": [
            {**MODEL, "name": "fake", "autoscaling": {"max_replicas": 4, "interval_s": 0.02}}]})
        deployment = FakeDeployment({"num_tokens": 2})
        deployment.tables["fake"] = {"fake/0": "serving", "fake/3": "serving"}
        deployment.role = Role.ATTACHED
        service = Service(config, deployment)
        await service.start()
        pool = service.router.pools["fake"]

        def healthy():
            return sorted(r.id for r in pool.healthy())
        try:
            await async_wait_for(lambda: healthy() == ["fake/0", "fake/3"], "the listed replicas to serve")
            deployment.tables["fake"] = {"fake/0": "draining", "fake/3": "serving", "fake/4": "serving"}
            await async_wait_for(lambda: healthy() == ["fake/3", "fake/4"], "fake/4 to serve and fake/0 to drain")
            assert [r.state for r in pool.replicas if r.id == "fake/0"] == [ReplicaState.DRAINING]
            deployment.tables["fake"] = {"fake/3": "serving", "fake/4": "serving"}
            await async_wait_for(lambda: sorted(r.id for r in pool.replicas) == ["fake/3", "fake/4"],
                                 "fake/0 to leave the pool")
        finally:
            await service.stop()

    asyncio.run(main())


def test_drain_timeout_ends_what_is_left_with_an_error():
    with _drain_setup(drain_timeout_s=0) as (url, service, deployment):
        pool = service.router.pools["fake"]
        victim = pool.replicas[0]
        engine = deployment.engines[victim.id]
        with cf.ThreadPoolExecutor(8) as ex:
            held = HeldStreams(ex, url, victim.id, lambda: setattr(engine, "stall", True),
                               lambda: len(engine.running), 6, TOKENS)
            _run(service, service.supervisor.scaling.drain_and_remove(victim), timeout=60)
            held.check()  # the victim's held streams: an error event then [DONE]; the others complete
        assert victim not in pool.replicas
