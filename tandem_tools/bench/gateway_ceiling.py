"""The gateway's own ceiling: streamed tokens/s through 1, 2, 4 gateway processes in front of
fake engines that answer at once (``token_delay_s: 0``), and the CPU each part spends per 1,000
streamed tokens (gateway processes, the parent, the replicas' actors, the load generator), read
from /proc.

    python -m tandem_tools.bench.gateway_ceiling --processes 1,2,4 --concurrency 32 --seconds 20

The load generator is a separate process (``--load``): raw HTTP/1.1 keep-alive connections on
asyncio, one streamed chat after another per connection, counting tokens in the bytes (no JSON,
no SSE parsing), so its CPU per token is a fraction of the gateway's; its CPU is reported next to
the gateways'. Each setup's server is started, measured and stopped before the next (one alive at
a time); ``--rounds`` interleaves the setups.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TICK = os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------ the load generator


async def _connection(host: str, port: int, body: bytes, stop_at: float, counts: list[int]) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
               f"content-length: {len(body)}\r\n\r\n").encode() + body
    try:
        while time.monotonic() < stop_at:
            writer.write(request)
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            if b" 200 " not in head.split(b"\r\n", 1)[0]:
                counts[1] += 1
                raise RuntimeError(head.decode(errors="replace"))
            tokens = 0
            while True:  # chunked: size line, data, CRLF ... until the 0-size chunk
                size = int((await reader.readuntil(b"\r\n")).strip(), 16)
                data = await reader.readexactly(size + 2)
                if size == 0:
                    break
                tokens += data.count(b"tok")
            counts[0] += tokens
            counts[2] += 1
    finally:
        writer.close()


async def _load(url: str, concurrency: int, seconds: float, warmup: float, tokens: int) -> dict:
    host, port = url.split("//")[1].split(":")
    body = json.dumps({"model": "fake", "messages": [{"role": "user", "content": "x"}], "stream": True,
                       "max_tokens": tokens}).encode()
    counts = [0, 0, 0]  # tokens, errors, requests
    t0 = time.monotonic()
    tasks = [asyncio.create_task(_connection(host, int(port), body, t0 + warmup + seconds, counts))
             for _ in range(concurrency)]
    await asyncio.sleep(warmup)
    start_counts, start_t, start_cpu = list(counts), time.monotonic(), time.process_time()
    marks = {"start": time.time()}
    await asyncio.gather(*tasks, return_exceptions=True)
    elapsed = time.monotonic() - start_t
    marks["end"] = time.time()
    return {"tokens": counts[0] - start_counts[0], "requests": counts[2] - start_counts[2],
            "errors": counts[1], "seconds": elapsed, "load_cpu_s": time.process_time() - start_cpu, **marks}


# ------------------------------------------------------------------ /proc


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


# ------------------------------------------------------------------ one setup


def _serve(config_path: str) -> int:
    import logging

    from gateway.config import load_config
    from gateway.processes import serve_processes
    from workers.deployment import RayDeployment

    logging.basicConfig(level=logging.WARNING)
    return serve_processes(load_config(config_path), functools.partial(RayDeployment, engine_key="fake"),
                           log_level="warning")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(processes: int, args, tmp: Path) -> dict:
    import httpx

    port = _free_port()
    config = {"gateway": {"host": "127.0.0.1", "port": port, "processes": processes, "max_queue": 4096,
                          "avoid_engine_cores": False},
              "ray": {"num_cpus": 4},
              "models": [{"name": "fake", "kind": "autoregressive", "source": "none", "replicas": args.replicas,
                          "max_in_flight_per_replica": 1024,
                          "resources": {"num_cpus": 0.1, "num_gpus": 0},
                          "engine_args": {"num_tokens": args.tokens, "token_delay_s": 0, "max_model_len": 100000}}]}
    cfg = tmp / f"ceiling-{processes}.json"
    cfg.write_text(json.dumps(config))
    log = open(tmp / f"ceiling-{processes}.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "tandem_tools.bench.gateway_ceiling", "--serve", str(cfg)],
                              cwd=REPO,
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(url + "/ready", timeout=10).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start; see {log.name}")
            time.sleep(0.5)  # a poll interval
        rows = httpx.get(url + "/admin/replicas", timeout=30).json()["replicas"]
        actors = [r["pid"] for r in rows]
        gateways = [p for p in children(server.pid) if "spawn_main" in cmdline(p)]
        load = subprocess.Popen([sys.executable, "-m", "tandem_tools.bench.gateway_ceiling", "--load", url,
                                 str(args.concurrency), str(args.seconds), str(args.warmup), str(args.tokens)],
                                cwd=REPO, stdout=subprocess.PIPE, text=True)
        time.sleep(args.warmup)  # the load generator's own warm-up: CPU counted from here
        before = {p: cpu_seconds(p) for p in [server.pid, *gateways, *actors]}
        out, _ = load.communicate(timeout=args.seconds + args.warmup + 120)
        after = {p: cpu_seconds(p) for p in before}
        result = json.loads(out.strip().splitlines()[-1])
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()
    k = result["tokens"] / 1000 or 1
    gw_cpu = sum(after[p] - before[p] for p in gateways)
    return {"processes": processes, "tok_s": result["tokens"] / result["seconds"],
            "req_s": result["requests"] / result["seconds"], "errors": result["errors"],
            "gateway_cpu_per_1k": gw_cpu / k, "gateway_cores": gw_cpu / result["seconds"],
            "parent_cpu_per_1k": (after[server.pid] - before[server.pid]) / k,
            "actors_cpu_per_1k": sum(after[p] - before[p] for p in actors) / k,
            "load_cpu_per_1k": result["load_cpu_s"] / k, "load_cores": result["load_cpu_s"] / result["seconds"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", default="1,2,4", help="gateway process counts to measure")
    parser.add_argument("--concurrency", type=int, default=32, help="streams at once")
    parser.add_argument("--seconds", type=float, default=20, help="measured seconds per setup")
    parser.add_argument("--warmup", type=float, default=3, help="unmeasured seconds first")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per streamed answer")
    parser.add_argument("--replicas", type=int, default=2, help="fake replicas")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--load", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        return _serve(args.serve)
    if args.load:
        url, conc, secs, warm, toks = args.load
        print(json.dumps(asyncio.run(_load(url, int(conc), float(secs), float(warm), int(toks)))))
        return 0
    results = []
    with tempfile.TemporaryDirectory(prefix="tandem-ceiling-") as tmp:
        for rnd in range(args.rounds):
            for n in [int(x) for x in args.processes.split(",")]:
                r = measure(n, args, Path(tmp))
                r["round"] = rnd
                results.append(r)
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}), flush=True)
    base = [r["tok_s"] for r in results if r["processes"] == 1]
    print(f"{'procs':>5} {'tok/s':>9} {'vs 1':>6} {'gw CPU s/1k tok':>16} {'gw cores':>8} {'actors s/1k':>11} "
          f"{'load s/1k':>9} {'load cores':>10}")
    for r in results:
        ratio = r["tok_s"] / (sum(base) / len(base)) if base else float("nan")
        print(f"{r['processes']:>5} {r['tok_s']:>9.0f} {ratio:>6.2f} {r['gateway_cpu_per_1k']:>16.4f} "
              f"{r['gateway_cores']:>8.2f} {r['actors_cpu_per_1k']:>11.4f} {r['load_cpu_per_1k']:>9.4f} "
              f"{r['load_cores']:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
