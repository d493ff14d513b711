"""What one hop between the gateway and a replica costs, by transport: a Ray actor call and a
Ray streaming-generator item (``submit`` and the channel with ``gateway.channel: ray``) against
a Unix socket between the same two kinds of process (asyncio streams, length-prefixed pickles,
as ``workers/transport/socket_channel.py`` sends over TCP with ``channel: socket``).

``python -m tandem_tools.bench.transport [--items 300] [--gap-ms 3]``: per transport, the
median and p90 of a call's round trip and of a streamed item's one-way latency (the far side
stamps CLOCK_MONOTONIC, one clock for a host), and the CPU time per streamed item of both
processes (/proc). Items are spaced like tokens at c=1 (``--gap-ms``), one item each, which
is what the channel carries at low concurrency. A diagnostic: nothing imports it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pickle
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tandem_tools.bench import procstat

HEADER = struct.Struct("!I")


def _summary(ns: list[int]) -> tuple[float, float]:
    ms = sorted(x / 1e6 for x in ns)
    return statistics.median(ms), ms[int(0.9 * (len(ms) - 1))]


# -- the far side of the socket (a child process) ------------------------------------------------
async def _send(writer: asyncio.StreamWriter, obj) -> None:
    data = pickle.dumps(obj, protocol=5)
    writer.write(HEADER.pack(len(data)) + data)
    await writer.drain()


async def _recv(reader: asyncio.StreamReader):
    (n,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return pickle.loads(await reader.readexactly(n))


async def _serve(path: str) -> None:
    async def handle(reader, writer):
        while True:
            try:
                op, arg = await _recv(reader)
            except asyncio.IncompleteReadError:
                return
            if op == "call":
                await _send(writer, time.monotonic_ns())
            else:  # stream: arg = (items, gap_s)
                for _ in range(arg[0]):
                    await asyncio.sleep(arg[1])
                    await _send(writer, time.monotonic_ns())
    server = await asyncio.start_unix_server(handle, path)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


async def _socket_client(path: str, items: int, gap_s: float, far_pid: int) -> dict:
    reader, writer = await asyncio.open_unix_connection(path)
    calls = []
    for _ in range(items):
        t0 = time.monotonic_ns()
        await _send(writer, ("call", None))
        await _recv(reader)
        calls.append(time.monotonic_ns() - t0)
    cpu0 = procstat.cpu_s(os.getpid()), procstat.cpu_s(far_pid)
    await _send(writer, ("stream", (items, gap_s)))
    lat = []
    for _ in range(items):
        stamp = await _recv(reader)
        lat.append(time.monotonic_ns() - stamp)
    cpu1 = procstat.cpu_s(os.getpid()), procstat.cpu_s(far_pid)
    writer.close()
    return {"call": calls, "item": lat, "cpu": (cpu1[0] - cpu0[0], cpu1[1] - cpu0[1])}


def run_socket(items: int, gap_s: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "s")
        child = subprocess.Popen([sys.executable, "-m", "tandem_tools.bench.transport", "--serve", path],
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "ready"
            return asyncio.run(_socket_client(path, items, gap_s, child.pid))
        finally:
            child.kill()
            child.wait()


# -- Ray --------------------------------------------------------------------------------------
def run_ray(items: int, gap_s: float) -> dict:
    import ray

    class Far:
        def pid(self) -> int:
            return os.getpid()

        async def call(self) -> int:
            return time.monotonic_ns()

        async def stream(self, n: int, gap: float):
            for _ in range(n):
                await asyncio.sleep(gap)
                yield time.monotonic_ns()

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        far = ray.remote(num_cpus=0)(Far).remote()
        far_pid = ray.get(far.pid.remote())

        async def client() -> dict:
            calls = []
            for _ in range(items):
                t0 = time.monotonic_ns()
                await far.call.remote()
                calls.append(time.monotonic_ns() - t0)
            cpu0 = procstat.cpu_s(os.getpid()), procstat.cpu_s(far_pid)
            lat = []
            async for ref in far.stream.options(num_returns="streaming").remote(items, gap_s):
                stamp = await ref
                lat.append(time.monotonic_ns() - stamp)
            cpu1 = procstat.cpu_s(os.getpid()), procstat.cpu_s(far_pid)
            return {"call": calls, "item": lat, "cpu": (cpu1[0] - cpu0[0], cpu1[1] - cpu0[1])}

        return asyncio.run(client())
    finally:
        ray.shutdown()


def format_rows(results: dict[str, dict], items: int) -> str:
    lines = ["| transport | call round trip p50 / p90 ms | stream item one-way p50 / p90 ms | "
             "CPU per item: near / far ms |", "|---|---|---|---|"]
    for name, r in results.items():
        c50, c90 = _summary(r["call"])
        i50, i90 = _summary(r["item"])
        near, far = (1000 * x / items for x in r["cpu"])
        lines.append(f"| {name} | {c50:.2f} / {c90:.2f} | {i50:.2f} / {i90:.2f} | {near:.3f} / {far:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem_tools.bench.transport", description=__doc__.split("\n\n")[0])
    p.add_argument("--items", type=int, default=300)
    p.add_argument("--gap-ms", type=float, default=3.0)
    p.add_argument("--serve", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        asyncio.run(_serve(args.serve))
        return 0
    gap = args.gap_ms / 1000
    results = {"unix socket": run_socket(args.items, gap), "ray": run_ray(args.items, gap)}
    print(f"{args.items} calls, then {args.items} streamed items {args.gap_ms} ms apart")
    print(format_rows(results, args.items))
    return 0


if __name__ == "__main__":
    sys.exit(main())
