"""Pieces of the several-gateway-processes mode that need no second process: the load other
gateways put on a replica (from the replica's per-channel count), the shared rate-limit store
(two limiters over one file stand for two processes), and the parent's listening socket."""

from __future__ import annotations

import asyncio
import math
import socket

import pytest

from gateway.admission.keys import RateLimiter, ResolvedKey
from gateway.admission.shared_limits import SharedStore, create_shared_limits, share
from gateway.config import parse_config
from gateway.fleet.health import others_load
from gateway.processes import bind_socket
from gateway.routing.replicas import Replica
from tandem_core.errors import RateLimited, TandemError
from tandem_core.protocol import EngineRequest
from tests.waiting import async_wait_for
from workers.actor import EngineActor
from workers.fake_engine import FakeEngine
from workers.transport.handles import LocalReplicaHandle


def test_others_load_is_what_other_channels_hold_on_the_replica():
    async def main():
        engine = FakeEngine("fake", {"num_tokens": 3})
        engine.stall = True  # requests stay in flight
        actor = EngineActor({"name": "fake", "kind": "autoregressive", "source": "none"}, "none", "fake/0",
                            engine=engine)
        mine, theirs = LocalReplicaHandle(actor), LocalReplicaHandle(actor)  # two gateway processes
        await mine.start()
        await theirs.start()
        body = {"model": "fake", "prompt": "x"}
        streams = [theirs.generate(EngineRequest("completions", body, f"r{i}")) for i in range(3)]
        tasks = [asyncio.ensure_future(s.__anext__()) for s in streams]
        await async_wait_for(lambda: len(engine.running) == 3, "three requests in the engine")
        replica = Replica(id="fake/0", model="fake", handle=mine)
        stats = await mine.stats()
        assert stats.extra["actor_in_flight"] == 3
        assert others_load(replica, stats.extra["channel_in_flight"]) == 3.0  # 1 unit each: none of mine
        replica.outstanding, replica.load = 2, 100.0  # mine weigh 50 each on average
        assert others_load(replica, stats.extra["channel_in_flight"]) == 150.0
        replica.handle = theirs  # seen from the other process: its own requests are not "others"
        assert others_load(replica, stats.extra["channel_in_flight"]) == 0.0
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await actor.shutdown()

    asyncio.run(main())


def _limiter(path: str | None, now: list[float]) -> RateLimiter:
    keys = [ResolvedKey("a", "sk-aaaaaaaa", requests_per_minute=3, tokens_per_minute=None),
            ResolvedKey("b", "sk-bbbbbbbb", requests_per_minute=1, tokens_per_minute=600)]
    limiter = RateLimiter(keys, clock=lambda: now[0])
    if path is not None:
        share(limiter, path)
    return limiter


def _config(tmp_path):
    return parse_config({"auth": {"api_keys": [{"key": "sk-aaaaaaaa", "name": "a", "requests_per_minute": 3},
                                               {"key": "sk-bbbbbbbb", "name": "b", "requests_per_minute": 1,
                                                "tokens_per_minute": 600}]},
                         "models": [{"name": "fake", "kind": "autoregressive", "source": "none"}]})


def test_two_limiters_over_one_store_share_each_keys_budget(tmp_path):
    path = create_shared_limits(_config(tmp_path), str(tmp_path))
    now = [1000.0]
    p1, p2 = _limiter(path, now), _limiter(path, now)  # two gateway processes
    p1.check_request("a")
    p2.check_request("a")
    p1.check_request("a")
    for p in (p1, p2):  # the 4th in the minute, whichever process takes it
        with pytest.raises(RateLimited):
            p.check_request("a")
    p2.check_request("b")  # keys do not share
    with pytest.raises(RateLimited):
        p1.check_request("b")
    now[0] += 20.0  # a third of a minute: one request of "a" back, for either process
    p2.check_request("a")
    with pytest.raises(RateLimited):
        p1.check_request("a")


def test_without_a_store_each_limiter_has_its_own_budget():
    now = [0.0]
    p1, p2 = _limiter(None, now), _limiter(None, now)
    for _ in range(3):
        p1.check_request("a")
    p2.check_request("a")  # the budget the shared store exists to prevent


def test_no_store_without_limits(tmp_path):
    config = parse_config({"models": [{"name": "fake", "kind": "autoregressive", "source": "none"}]})
    assert create_shared_limits(config, str(tmp_path)) is None


def test_store_starts_full_and_the_lock_excludes_other_open_files(tmp_path):
    path = create_shared_limits(_config(tmp_path), str(tmp_path))
    store = SharedStore(path)
    assert len(store.values) == 8 and all(math.isnan(v) for v in store.values)
    import fcntl
    import os

    other = os.open(path, os.O_RDWR)  # another process's open file
    try:
        with store.locked():
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(other, fcntl.LOCK_UN)
    finally:
        os.close(other)


def test_the_parent_socket_is_inherited_and_listening():
    sock = bind_socket("127.0.0.1", 0)
    try:
        assert sock.get_inheritable()
        with socket.create_connection(sock.getsockname()[:2], timeout=5):
            conn, _ = sock.accept()
            conn.close()
    finally:
        sock.close()


def test_a_channel_past_its_lease_is_closed_and_its_requests_end():
    """A gateway process killed outright leaves its channel open on the replica (Ray does not end
    a dead caller's stream): the lease its health checks renew runs out, the replica closes it and
    aborts its requests; a channel that renews, or never took a lease, is untouched."""
    async def main():
        engine = FakeEngine("fake", {"num_tokens": 3})
        engine.stall = True
        actor = EngineActor({"name": "fake", "kind": "autoregressive", "source": "none"}, "none", "fake/0",
                            engine=engine)
        owner, alive, gone = (LocalReplicaHandle(actor) for _ in range(3))
        for h in (owner, alive, gone):
            await h.start()
        body = {"model": "fake", "prompt": "x"}
        streams = {h: h.generate(EngineRequest("completions", body, f"r-{i}")) for i, h in enumerate((owner, alive, gone))}
        tasks = {h: asyncio.ensure_future(s.__anext__()) for h, s in streams.items()}
        await async_wait_for(lambda: len(engine.running) == 3, "three requests in the engine")
        await actor.health(alive.channel_id, 1000.0)
        await actor.health(gone.channel_id, -1.0)  # a lease already over: reaped by this very call
        item = await tasks[gone]  # the request ends with an error (nothing had streamed yet)
        assert isinstance(item, TandemError) and "lapsed" in item.message, item
        await async_wait_for(lambda: len(engine.running) == 2, "the gone channel's request aborted")
        assert set(actor._channels) == {owner.channel_id, alive.channel_id}
        for h in (owner, alive):
            tasks[h].cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        await actor.shutdown()

    asyncio.run(main())


def test_serve_refuses_bad_process_options(capsys):
    from tandem_tools.cli import main

    assert main(["serve", "--processes", "0"]) == 2
    assert "--processes must be at least 1" in capsys.readouterr().err
    assert main(["serve", "--attach"]) == 2  # the default config starts a local Ray: nothing to attach to
    assert "set ray.address" in capsys.readouterr().err


def test_who_serves_the_metrics_port():
    """The replicas' owner serves `metrics.port`; an attached gateway process of a group does not
    (its parent serves the group's); a lone `tandem serve --attach` serves its own gateway's."""
    from gateway.config import parse_config
    from gateway.serving.service import Service
    from tandem_core.protocol import Role
    from workers.fake_engine import FakeDeployment

    class Attached(FakeDeployment):
        role = Role.ATTACHED

    config = parse_config({"metrics": {"port": 9}, "models": [{"name": "fake", "kind": "autoregressive",
                                                                "source": "none"}]})
    assert Service(config, FakeDeployment()).serves_metrics_port
    assert not Service(config, Attached()).serves_metrics_port
    assert Service(config, Attached(), metrics_port=True).serves_metrics_port
