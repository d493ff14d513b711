"""A client that goes away has its request aborted in the engine: vLLM's replica counts it as
aborted (its iterator was cancelled, which is how vLLM aborts) and holds no running request.
The abort is proven by the counter, not by how fast the request left: a 480-token answer that
had merely finished would not count as aborted."""

import asyncio

import httpx

from tests.waiting import async_wait_for, wait_for

LONG = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 480,
        "ignore_eos": True}


def _engine(stack) -> dict:
    (row,) = stack.replica_stats()
    return row["engine"]


def _aborted_and_clear(stack, aborted_before: int) -> None:
    took = wait_for(lambda: _engine(stack)["aborted"] > aborted_before and _engine(stack)["running"] == 0,
                    "the engine to abort the dropped request and hold nothing")
    wait_for(lambda: all(r["outstanding"] == 0 for r in stack.replica_stats()), "the gateway to release its slot")
    print(f"aborted {took:.2f} s after the client went away")  # a figure, not a bound


def test_dropped_stream_is_aborted(stack):
    aborted = _engine(stack)["aborted"]
    with httpx.stream("POST", stack.url + "/v1/chat/completions", json={**LONG, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert _engine(stack)["running"] == 1  # it is really in the engine
    _aborted_and_clear(stack, aborted)


def test_dropped_non_streaming_request_is_aborted(stack):
    aborted = _engine(stack)["aborted"]

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            task = asyncio.create_task(client.post(stack.url + "/v1/chat/completions", json=LONG))
            await async_wait_for(lambda: _engine(stack)["running"] == 1, "the engine to hold the request")
            task.cancel()  # closes the connection
            try:
                await task
            except asyncio.CancelledError:
                pass

    asyncio.run(main())
    _aborted_and_clear(stack, aborted)
