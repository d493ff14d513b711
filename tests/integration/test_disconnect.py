"""A client that goes away leaves the engine with no running request within a second."""

import asyncio
import time

import httpx

LONG = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 480,
        "ignore_eos": True}


def _engine_running(stack) -> int:
    return sum(r["engine"]["running"] for r in stack.replica_stats())


def _wait_running(stack, want, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _engine_running(stack) == want:
            return time.monotonic()
        time.sleep(0.02)
    raise AssertionError(f"engine still reports {_engine_running(stack)} running after {timeout} s")


def test_dropped_stream_is_aborted(stack):
    with httpx.stream("POST", stack.url + "/v1/chat/completions", json={**LONG, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert _engine_running(stack) == 1  # it is really in the engine
    t_drop = time.monotonic()
    t_clear = _wait_running(stack, 0, timeout=1.0)
    assert t_clear - t_drop < 1.0


def test_dropped_non_streaming_request_is_aborted(stack):
    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            task = asyncio.create_task(client.post(stack.url + "/v1/chat/completions", json=LONG))
            t0 = time.monotonic()
            while _engine_running(stack) != 1:  # wait until the engine holds it
                assert time.monotonic() - t0 < 30, "request never reached the engine"
                await asyncio.sleep(0.02)
            task.cancel()  # closes the connection
            try:
                await task
            except asyncio.CancelledError:
                pass
        return time.monotonic()

    t_drop = asyncio.run(main())
    t_clear = _wait_running(stack, 0, timeout=1.0)
    assert t_clear - t_drop < 1.0
    assert all(r["outstanding"] == 0 for r in stack.replica_stats())
