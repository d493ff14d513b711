"""The channel over TCP (``workers/transport/socket_channel.py``), both ends in this process: an
``EngineActor`` with a fake engine and a ``LocalReplicaHandle`` that reaches it as a gateway
process reaches a Ray replica with ``channel: socket`` (only the actor calls are in-process)."""

from __future__ import annotations

import asyncio
import pickle
import socket

import pytest

from tandem_core.errors import ErrorKind, TandemError
from tandem_core.protocol import DONE, EngineInfo, EngineRequest
from tests.waiting import async_wait_for
from workers.actor import EngineActor
from workers.fake_engine import FakeEngine
from workers.transport.channel import END
from workers.transport.handles import LocalReplicaHandle
from workers.transport.socket_channel import HEADER, TOKEN_BYTES, encode, read_frame

MODEL = {"name": "fake", "kind": "autoregressive", "source": "none"}
BODY = {"model": "fake", "prompt": "x", "stream": True}


def _actor(engine=None, **engine_args) -> EngineActor:
    engine = engine or FakeEngine("fake", {"num_tokens": 3, **engine_args})
    return EngineActor(MODEL, "none", "fake/0", engine=engine)


async def _started(actor: EngineActor, channel: str = "socket", factory=None) -> LocalReplicaHandle:
    handle = LocalReplicaHandle(actor, factory=factory, channel=channel)
    await handle.start()
    return handle


async def _collect(handle, request_id: str, route: str = "completions", body=BODY) -> list:
    out = []
    try:
        async for item in handle.generate(EngineRequest(route, body, request_id)):
            out.append(item)
    except TandemError as e:  # mid-stream: raised (the gateway sends it as an error event)
        out.append(e)
    return out


@pytest.mark.parametrize("channel", ["socket", "ray"])
def test_every_request_gets_its_own_items_in_order(channel):
    async def main():
        actor = _actor(num_tokens=5)
        handle = await _started(actor, channel)
        results = await asyncio.gather(*(_collect(handle, f"r{i}") for i in range(6)))
        await handle.shutdown()
        return results

    for i, items in enumerate(asyncio.run(main())):
        text = "".join(items)
        assert text.endswith(DONE) and text.count(f'"id": "r{i}"') == 6, text  # 5 tokens + the finish chunk
        assert [f"tok{k} " for k in range(5)] == [w for w in _words(text)]


def _words(sse: str) -> list[str]:
    import json

    out = []
    for event in sse.split("\n\n"):
        if event.startswith("data: {"):
            text = json.loads(event[6:])["choices"][0]["text"]
            if text:
                out.append(text)
    return out


def test_a_wrong_token_is_refused_before_anything_is_unpickled_and_the_server_serves_on():
    unpickled = []

    class Bomb:
        def __reduce__(self):
            return (unpickled.append, ("unpickled!",))

    async def refused(host, port, payload: bytes) -> bytes:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(payload)
        got = await reader.read()  # the server closes: EOF, nothing sent
        writer.close()
        return got

    async def main():
        actor = _actor()
        host, port, token = await actor.open_socket("c-1")
        assert len(token) == TOKEN_BYTES
        wrong = bytes(b ^ 1 for b in token)
        assert await refused(host, port, HEADER.pack(TOKEN_BYTES) + wrong) == b""
        assert await refused(host, port, encode(Bomb())) == b""  # a pickle where the token goes
        assert await refused(host, port, HEADER.pack(TOKEN_BYTES) + pickle.dumps(Bomb())[:TOKEN_BYTES]) == b""
        assert actor._socket_server.refused == 3 and actor._channels == {}
        # A client with the right token is served, on the same listening socket.
        handle = await _started(actor)
        items = await _collect(handle, "r1")
        assert "".join(items).endswith(DONE)
        # A token is good for one connection: the one just used is refused now.
        _, _, used = await actor.open_socket("c-2")
        await actor.open_socket("c-2")  # a new offer for the channel replaces that token
        assert await refused(host, port, HEADER.pack(TOKEN_BYTES) + used) == b""
        await handle.shutdown()

    asyncio.run(main())
    assert unpickled == []


def test_a_gateway_that_drops_its_connection_fails_its_requests_and_the_replica_aborts_them():
    async def main():
        engine = FakeEngine("fake", {"num_tokens": 3})
        engine.stall = True  # requests stay in flight
        actor = _actor(engine)
        handle = await _started(actor)
        broken = []
        handle.on_broken = broken.append
        tasks = [asyncio.ensure_future(_collect(handle, f"r{i}")) for i in range(3)]
        await async_wait_for(lambda: len(engine.running) == 3, "three requests in the engine")
        handle._link._client.result().close()  # as the kernel does for a gateway process killed outright
        results = await asyncio.gather(*tasks)
        await async_wait_for(lambda: sorted(engine.aborted) == ["r0", "r1", "r2"], "the replica aborts all three")
        await async_wait_for(lambda: actor._channels == {}, "the replica forgets the channel")
        return results, broken

    results, broken = asyncio.run(main())
    for items in results:
        assert len(items) == 1 and isinstance(items[0], TandemError) and items[0].kind is ErrorKind.ENGINE_DEAD
    assert [e.kind for e in broken] == [ErrorKind.ENGINE_DEAD]


def test_a_replica_that_drops_the_connection_fails_every_request_on_it():
    async def main():
        engine = FakeEngine("fake", {"num_tokens": 3})
        actor = _actor(engine)
        handle = await _started(actor)
        broken = []
        handle.on_broken = broken.append
        first = await _collect(handle, "done-before")  # served normally first
        engine.num_tokens, engine.token_delay_s = 100_000, 0.01  # a request that streams on and on
        streaming = handle.generate(EngineRequest("completions", BODY, "r-mid"))
        assert isinstance(await anext(streaming), str)  # its first token is out
        engine.stall = True  # and no more tokens for anyone
        waiting = asyncio.ensure_future(_collect(handle, "r-wait"))
        await async_wait_for(lambda: "r-wait" in engine.running, "the second request in the engine")
        actor._socket_server.close(drop=True)  # the replica's end goes (its process died)
        rest = [item async for item in streaming]
        return first, rest[-1], await waiting, broken

    first, mid, waiting, broken = asyncio.run(main())
    assert "".join(first).endswith(DONE)
    assert isinstance(mid, TandemError) and mid.kind is ErrorKind.ENGINE_DEAD  # after output: its last item
    assert len(waiting) == 1 and waiting[0].kind is ErrorKind.ENGINE_DEAD  # before output: its error
    assert [e.kind for e in broken] == [ErrorKind.ENGINE_DEAD]


def test_a_submit_error_reaches_its_request():
    def refuse(body, request_id):  # an engine that refuses before it yields anything
        if body.get("prompt") == "bad":
            raise TandemError(ErrorKind.INVALID_REQUEST, "refused at submit", "prompt")
        raise RuntimeError("engine bug")

    async def main():
        engine = FakeEngine("fake", {"num_tokens": 3})
        actor = _actor(engine)
        handle = await _started(actor)
        not_served = await _collect(handle, "r0", "messages", {"model": "fake", "messages": []})
        engine.completions = refuse
        refused = await _collect(handle, "r1", body={"prompt": "bad"})
        crashed = await _collect(handle, "r2", body={"prompt": "x"})
        del engine.completions
        after = await _collect(handle, "r3")  # the channel serves on
        await handle.shutdown()
        return not_served, refused, crashed, after

    not_served, refused, crashed, after = asyncio.run(main())
    assert len(not_served) == 1 and not_served[0].kind is ErrorKind.INVALID_REQUEST  # the route is not served
    assert refused == [TandemError(ErrorKind.INVALID_REQUEST, "refused at submit", "prompt")]
    assert len(crashed) == 1 and crashed[0].kind is ErrorKind.ENGINE_ERROR
    assert "".join(after).endswith(DONE)


def test_a_client_that_leaves_aborts_its_request_over_the_socket():
    async def main():
        engine = FakeEngine("fake", {"num_tokens": 3})
        actor = _actor(engine)
        handle = await _started(actor)
        engine.stall = True
        stream = handle.generate(EngineRequest("completions", BODY, "r-left"))
        first = asyncio.ensure_future(anext(stream))
        await async_wait_for(lambda: "r-left" in engine.running, "the request in the engine")
        first.cancel()  # the HTTP client went away
        await asyncio.gather(first, return_exceptions=True)
        await stream.aclose()
        await async_wait_for(lambda: engine.aborted == ["r-left"], "the engine aborts it")
        assert handle._demux.broken is None  # the channel lives on
        engine.stall = False
        after = await _collect(handle, "r-after")
        await handle.shutdown()
        return after

    assert "".join(asyncio.run(main())).endswith(DONE)


class _Fed:
    """An engine whose one request yields what the test feeds it (None ends it)."""

    def __init__(self):
        self.feed: asyncio.Queue = asyncio.Queue()
        self.produced = 0

    async def start(self):
        return EngineInfo(model="fake", kind="fake", max_model_len=64)

    def completions(self, body, request_id):
        return self._items()

    async def _items(self):
        while (item := await self.feed.get()) is not None:
            self.produced += 1
            yield item

    async def abort(self, request_id):
        return False

    async def shutdown(self):
        pass


def test_a_reader_that_does_not_read_stops_the_pump_until_it_drains():
    async def main():
        engine = _Fed()
        actor = _actor(engine)
        await actor.start()
        host, port, token = await actor.open_socket("slow")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)  # small kernel buffers: less to fill
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
        reader, writer = await asyncio.open_connection(sock=sock)
        writer.write(HEADER.pack(len(token)) + token + encode(("submit", EngineRequest("completions", {}, "r"))))
        await async_wait_for(lambda: "slow" in actor._channels and actor._socket_server._writers, "the channel open")
        server, outbox = actor._socket_server, actor._channels["slow"]
        transport = next(iter(server._writers)).transport
        high = transport.get_write_buffer_limits()[1]
        blob = "x" * 65536
        sent = 0  # 1. feed items until the kernel's buffers are full and the server's transport holds
        while transport.get_write_buffer_size() <= high:  # more than its high-water mark: paused
            assert sent < 2000, "the socket never filled up"
            engine.feed.put_nowait({"i": sent, "blob": blob})  # whole items: never joined in the outbox
            sent += 1
            await async_wait_for(lambda n=sent: engine.produced == n and (
                not outbox._items or transport.get_write_buffer_size() > high), "the item taken or the pump held")
        frames = server.frames_sent
        for i in range(sent, sent + 20):  # 2. what comes now waits in the outbox: the pump awaits drain()
            engine.feed.put_nowait({"i": i, "blob": blob})
        engine.feed.put_nowait(None)
        await async_wait_for(lambda: outbox._items and outbox._items[-1] == ("r", END), "the request's end produced")
        held = len(outbox._items)
        assert server.frames_sent == frames
        got = []
        while not got or got[-1] != ("r", END):  # 3. now read: everything arrives, in order
            got.extend(await read_frame(reader))
        writer.close()
        return got, sent, held, frames

    got, sent, held, frames = asyncio.run(main())
    print(f"{frames} batches ({sent} items) filled the socket; {held} items waited in the outbox")
    assert held == 21  # 20 items and the END
    assert [item["i"] for _, item in got[:-1]] == list(range(sent + 20))


def test_a_restarted_replica_gets_a_new_connection():
    async def main():
        engines = []

        def make():
            engines.append(FakeEngine("fake", {"num_tokens": 3}))
            return _actor(engines[-1])

        handle = await _started(make(), factory=make)
        old_actor = handle.actor
        host, port, _ = await old_actor.open_socket("probe")
        engines[0].stall = True
        in_flight = asyncio.ensure_future(_collect(handle, "r-old"))
        await async_wait_for(lambda: "r-old" in engines[0].running, "the request in the old replica")
        await handle.restart(kill=True)
        old = await in_flight
        after = await _collect(handle, "r-new")
        with pytest.raises(OSError):  # the old process's socket is gone
            await asyncio.open_connection(host, port)
        new_channels = set(handle.actor._channels)
        await handle.shutdown()
        return old, after, engines, new_channels, handle.channel_id

    old, after, engines, new_channels, channel_id = asyncio.run(main())
    assert len(old) == 1 and old[0].kind is ErrorKind.ENGINE_DEAD
    assert "".join(after).endswith(DONE) and engines[1].served == ["r-new"]
    assert new_channels == {channel_id}


def test_an_unknown_channel_kind_is_refused():
    with pytest.raises(ValueError, match="unknown channel"):
        LocalReplicaHandle(_actor(), channel="pigeon")


def test_the_bench_runs_tandem_on_both_channels(tmp_path):
    import argparse

    import yaml

    from tandem_tools.bench.setups import TANDEM_RAY, build_setups

    setups = build_setups(argparse.Namespace(port=9), "/m", tmp_path)
    channels = {}
    for name in ("tandem", TANDEM_RAY):
        argv = setups[name].servers[0].argv
        channels[name] = yaml.safe_load(open(argv[argv.index("--config") + 1]))["gateway"]["channel"]
    assert channels == {"tandem": "socket", TANDEM_RAY: "ray"}


def test_an_item_that_cannot_be_pickled_fails_its_request_only():
    from workers.transport.socket_channel import encode_batch

    batch = [("a", "data: 1\n\n"), ("b", lambda: None), ("a", END)]
    (n,) = HEADER.unpack(encode_batch(batch)[:HEADER.size])
    decoded = pickle.loads(encode_batch(batch)[HEADER.size:])
    assert n > 0 and decoded[0] == ("a", "data: 1\n\n") and decoded[2] == ("a", END)
    assert decoded[1][0] == "b" and decoded[1][1].kind is ErrorKind.ENGINE_ERROR
