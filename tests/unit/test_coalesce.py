import asyncio

import pytest

from gateway.errors import ErrorKind, TandemError
from workers.coalesce import coalesce
from workers.protocol import DONE


async def _gen(items, gate=None):
    for i, x in enumerate(items):
        if gate is not None and i == 1:
            await gate.wait()
        yield x


def _run(coro):
    return asyncio.run(coro)


def test_ready_items_are_joined_into_one():
    async def main():
        gate = asyncio.Event()
        out = []
        it = coalesce(_gen(["a", "b", "c", DONE], gate), "r")
        out.append(await anext(it))       # only "a" is ready
        gate.set()
        await asyncio.sleep(0.01)          # let the pump fill the queue
        out.extend([x async for x in it])
        return out
    assert _run(main()) == ["a", "bc" + DONE]


def test_json_item_passes_alone():
    async def main():
        return [x async for x in coalesce(_gen([{"id": 1}]), "r")]
    assert _run(main()) == [{"id": 1}]


async def _failing(after: list):
    for x in after:
        yield x
    raise RuntimeError("boom")


def test_failure_before_output_is_an_error_item_and_after_is_an_event():
    async def main(prefix):
        return [x async for x in coalesce(_failing(prefix), "r")]
    before = _run(main([]))
    assert len(before) == 1 and isinstance(before[0], TandemError) and before[0].kind is ErrorKind.ENGINE_ERROR
    after = _run(main(["data: x\n\n"]))
    assert after[-1].endswith(DONE) and '"error"' in after[-1]


def test_closing_cancels_the_engine_iterator():
    cancelled = []

    async def slow():
        try:
            yield "a"
            await asyncio.sleep(10)
            yield "b"
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def main():
        running = {}
        it = coalesce(slow(), "r", running)
        assert await anext(it) == "a"
        assert "r" in running
        await it.aclose()
        return running

    assert _run(main()) == {} and cancelled == [True]


def test_cancelling_the_registered_task_ends_the_stream():
    async def main():
        running = {}

        async def forever():
            yield "a"
            await asyncio.Event().wait()

        it = coalesce(forever(), "r", running)
        assert await anext(it) == "a"
        running["r"].cancel()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(anext(it), 1)

    _run(main())
