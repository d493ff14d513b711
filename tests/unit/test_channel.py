"""The multiplexed channel between a gateway and a replica (both halves, no Ray)."""

import asyncio

import pytest

from tandem_core.errors import ErrorKind, TandemError
from tandem_core.protocol import DONE
from workers.transport.channel import END, Demux, Outbox, items_of


async def _gen(items, gate=None):
    for i, x in enumerate(items):
        if gate is not None and i == 1:
            await gate.wait()
        yield x


async def _pump(outbox: Outbox, demux: Demux):
    async for batch in outbox.stream():
        demux.feed(batch)


def test_requests_share_one_stream_and_text_is_joined():
    async def main():
        outbox, batches = Outbox(), []
        outbox.start("a", _gen(["a1", "a2", DONE]))
        outbox.start("b", _gen([{"id": "b"}]))
        await asyncio.sleep(0.01)  # the loop runs every ready task before it sleeps (no I/O): deterministic
        stream = outbox.stream()
        batches.append(await anext(stream))
        outbox.close()
        return batches

    (batch,) = asyncio.run(main())
    assert len(batch) == 4  # both requests in one batch; a's text joined into one item
    assert [x for r, x in batch if r == "a"] == ["a1a2" + DONE, END]
    assert [x for r, x in batch if r == "b"] == [{"id": "b"}, END]


def test_demux_routes_each_request_its_own_items_in_order():
    async def main():
        outbox, demux = Outbox(), Demux()
        qa, qb = demux.register("a"), demux.register("b")
        pump = asyncio.create_task(_pump(outbox, demux))
        gate = asyncio.Event()
        outbox.start("a", _gen(["x", "y", DONE], gate))
        outbox.start("b", _gen(["p", "q", DONE]))
        await asyncio.sleep(0.01)  # the loop runs every ready task before it sleeps (no I/O): deterministic
        gate.set()
        a = [i async for i in items_of(qa)]
        b = [i async for i in items_of(qb)]
        outbox.close()
        await pump
        return a, b

    a, b = asyncio.run(main())
    assert "".join(a) == "xy" + DONE and "".join(b) == "pq" + DONE


def test_engine_failure_before_and_after_output():
    async def failing(prefix):
        for x in prefix:
            yield x
        raise RuntimeError("boom")

    async def main(prefix):
        outbox, demux = Outbox(), Demux()
        q = demux.register("r")
        pump = asyncio.create_task(_pump(outbox, demux))
        outbox.start("r", failing(prefix))
        out = [i async for i in items_of(q)]
        outbox.close()
        await pump
        return out

    before = asyncio.run(main([]))
    assert len(before) == 1 and isinstance(before[0], TandemError) and before[0].kind is ErrorKind.ENGINE_ERROR
    after = asyncio.run(main(["data: x\n\n"]))  # after a stream began: still the error as a value
    assert after[0] == "data: x\n\n" and isinstance(after[-1], TandemError) and len(after) == 2
    assert after[-1].kind is ErrorKind.ENGINE_ERROR  # the gateway frames it for its route (sse_body)


def test_abort_cancels_the_engine_iterator_and_ends_the_request():
    cancelled = []

    async def forever():
        try:
            yield "a"
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def main():
        outbox, demux = Outbox(), Demux()
        q = demux.register("r")
        pump = asyncio.create_task(_pump(outbox, demux))
        outbox.start("r", forever())
        it = items_of(q)
        assert await anext(it) == "a"
        assert outbox.abort("r") and not outbox.abort("unknown")
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(anext(it), 1)
        assert outbox.tasks == {}
        outbox.close()
        await pump

    asyncio.run(main())
    assert cancelled == [True]


def test_a_broken_channel_fails_every_request_on_it():
    async def main():
        demux = Demux()
        qa, qb = demux.register("a"), demux.register("b")
        demux.feed([("a", "data: 1\n\n")])
        demux.fail_all(TandemError(ErrorKind.ENGINE_DEAD, "gone"))
        got_b = [i async for i in items_of(qb)]
        got_a = [i async for i in items_of(qa)]  # mid-stream: an error item too (the gateway frames it)
        assert got_a[0] == "data: 1\n\n" and len(got_a) == 2 and got_a[1].kind is ErrorKind.ENGINE_DEAD
        with pytest.raises(TandemError):
            demux.register("c")  # a broken channel takes no new requests
        return got_b

    got_b = asyncio.run(main())
    assert len(got_b) == 1 and got_b[0].kind is ErrorKind.ENGINE_DEAD  # before output: an error item


def test_late_items_of_an_unregistered_request_are_dropped():
    demux = Demux()
    demux.feed([("gone", "data: x\n\n")])
    assert demux.queues == {}
