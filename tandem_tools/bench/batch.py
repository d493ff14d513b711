"""The Batch API on one tiny-llama replica (issue 34): a batch's lines/s against the same requests
sent online at the same concurrency (interleaved rounds), an interactive user's TTFT alone and
with a batch saturating the replica, and the time a batch takes to resume after `tandem serve`
is killed (SIGKILL) and started again.

    python -m tandem_tools.bench.batch            (or: tandem bench --mode batch)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import yaml

from tandem_tools.bench import procstat
from tandem_tools.bench.loadgen import one_stream, percentile
from tandem_tools.bench.servers import Server, prompts

REPO = Path(__file__).resolve().parents[2]
logger = logging.getLogger("tandem.bench")
MODEL = "tiny-llama"


def config(port: int, data_dir: Path, lines_in_flight: int) -> dict:
    return {"gateway": {"port": port}, "ray": {"num_cpus": 2}, "models_dir": str(REPO / "models"),
            "batches": {"data_dir": str(data_dir), "lines_in_flight": lines_in_flight, "poll_s": 0.5, "lease_s": 3},
            "models": [{"name": MODEL, "kind": "autoregressive", "source": "builtin:tiny-llama", "replicas": 1,
                        "resources": {"num_gpus": 0, "num_cpus": 1}, "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
                        "engine_args": {"enforce_eager": True, "max_model_len": 512, "dtype": "float32"}}]}


def _lines(n: int, max_tokens: int, tag: str) -> list[dict]:
    texts = prompts(64, seed=7)
    return [{"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True,
                      "messages": [{"role": "user", "content": texts[i % 64]}]}} for i in range(n)]


def submit(url: str, lines: list[dict]) -> str:
    with httpx.Client(base_url=url, timeout=120) as c:
        f = c.post("/v1/files", files={"file": ("b.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode())},
                   data={"purpose": "batch"}).json()
        return c.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": "/v1/chat/completions",
                                           "completion_window": "24h"}).json()["id"]


def wait_batch(url: str, batch_id: str, until=("completed", "failed", "expired", "cancelled"),
               min_completed: int | None = None, timeout: float = 1800) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        b = httpx.get(f"{url}/v1/batches/{batch_id}", timeout=60).json()
        if b["status"] in until or (min_completed is not None and b["request_counts"]["completed"] >= min_completed):
            return b
        time.sleep(0.2)
    raise TimeoutError(f"batch {batch_id} did not finish in {timeout:.0f} s")


async def online(url: str, lines: list[dict], concurrency: int) -> dict:
    """The batch's requests sent as online (non-streaming) requests, ``concurrency`` at a time."""
    queue = list(lines)
    errors = 0
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency + 2)) as client:
        async def worker() -> None:
            nonlocal errors
            while queue:
                line = queue.pop()
                r = await client.post(f"{url}/v1/chat/completions", json=line["body"])
                errors += r.status_code != 200
        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {"lines_per_s": len(lines) / (time.monotonic() - t0), "errors": errors}


def batch_alone(url: str, lines: list[dict]) -> dict:
    t0 = time.monotonic()
    b = wait_batch(url, submit(url, lines))
    wall = time.monotonic() - t0
    return {"lines_per_s": len(lines) / wall, "status": b["status"], "failed": b["request_counts"]["failed"]}


async def interactive(url: str, n: int, max_tokens: int) -> dict:
    ttfts, errors = [], 0
    async with httpx.AsyncClient(timeout=600) as client:
        for text in prompts(n, seed=1000):
            body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                    "stream": True, "ignore_eos": True}
            r = await one_stream(client, f"{url}/v1/chat/completions", body)
            if r.ok:
                ttfts.append(r.ttft_s * 1000)
            else:
                errors += 1
    return {"ttft_p50_ms": percentile(ttfts, 0.5), "ttft_p90_ms": percentile(ttfts, 0.9),
            "ttft_p99_ms": percentile(ttfts, 0.99), "n": len(ttfts), "errors": errors}


def _gateway_cpu(server: Server) -> float:
    return sum(procstat.cpu_s(p) for p in procstat.tree(server.proc.pid) if "tandem" in procstat.cmdline(p))


def run(args, workdir: Path) -> dict:
    cfg_path = workdir / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(config(args.port, workdir / "data", args.concurrency)))
    tandem = str(Path(sys.executable).parent / "tandem")
    argv = [tandem, "serve", "--config", str(cfg_path)]
    url = f"http://127.0.0.1:{args.port}"
    out: dict = {"rounds": []}
    with Server("tandem", argv, args.port, f"/ready?model={MODEL}", workdir / "serve.log", dict(os.environ)) as s:
        s.wait_ready(args.ready_timeout)
        for rnd in range(args.rounds):  # interleaved: online, batch, online, batch...
            lines = _lines(args.lines, args.max_tokens, f"r{rnd}")
            cpu0 = _gateway_cpu(s)
            on = asyncio.run(online(url, lines, args.concurrency))
            cpu1 = _gateway_cpu(s)
            ba = batch_alone(url, lines)
            cpu2 = _gateway_cpu(s)
            on["gateway_cpu_ms_per_line"] = (cpu1 - cpu0) * 1000 / len(lines)
            ba["gateway_cpu_ms_per_line"] = (cpu2 - cpu1) * 1000 / len(lines)
            out["rounds"].append({"online": on, "batch": ba})
            logger.info("round %d: online %.1f lines/s, batch %.1f lines/s", rnd, on["lines_per_s"], ba["lines_per_s"])
        out["interactive_alone"] = asyncio.run(interactive(url, args.interactive, args.interactive_tokens))
        batch_id = submit(url, _lines(args.lines, args.max_tokens, "busy"))
        wait_batch(url, batch_id, min_completed=args.concurrency)  # the batch fills the replica first
        out["interactive_with_batch"] = asyncio.run(interactive(url, args.interactive, args.interactive_tokens))
        status = wait_batch(url, batch_id, min_completed=0)["status"]
        out["interactive_with_batch"]["batch_still_running"] = status == "in_progress"
        wait_batch(url, batch_id)
        # Kill in the middle of a batch, start again: how long until it makes progress, and ends.
        batch_id = submit(url, _lines(args.lines, args.max_tokens, "killed"))
        before = wait_batch(url, batch_id, min_completed=args.lines // 4)["request_counts"]["completed"]
        os.killpg(s.proc.pid, signal.SIGKILL)
        s.proc.wait(30)
    t0 = time.monotonic()
    with Server("tandem", argv, args.port, f"/ready?model={MODEL}", workdir / "restart.log", dict(os.environ)) as s:
        s.wait_ready(args.ready_timeout)
        ready = time.monotonic() - t0
        progressed = wait_batch(url, batch_id, min_completed=before + 1)
        resumed = time.monotonic() - t0
        b = wait_batch(url, batch_id)
        ids = [json.loads(x)["custom_id"] for x in httpx.get(f"{url}/v1/files/{b['output_file_id']}/content",
                                                              timeout=120).text.splitlines()]
        out["resume"] = {"done_before_kill": before, "ready_s": ready, "first_new_line_s": resumed,
                         "completed_s": time.monotonic() - t0, "status": b["status"],
                         "custom_ids_once": len(ids) == len(set(ids)) == args.lines,
                         "progressed_at_completed": progressed["request_counts"]["completed"]}
    return out


def report(r: dict) -> str:
    on = [x["online"]["lines_per_s"] for x in r["rounds"]]
    ba = [x["batch"]["lines_per_s"] for x in r["rounds"]]
    alone, busy = r["interactive_alone"], r["interactive_with_batch"]
    res = r["resume"]
    return "\n".join([
        f"lines/s online: {', '.join(f'{x:.1f}' for x in on)}; batch: {', '.join(f'{x:.1f}' for x in ba)}; "
        f"batch / online per round: {', '.join(f'{b / o:.2f}' for b, o in zip(ba, on, strict=True))}",
        "gateway CPU ms/line online: " + ", ".join(f"{x['online']['gateway_cpu_ms_per_line']:.2f}" for x in r["rounds"])
        + "; batch: " + ", ".join(f"{x['batch']['gateway_cpu_ms_per_line']:.2f}" for x in r["rounds"]),
        f"interactive TTFT p50/p90/p99 ms alone {alone['ttft_p50_ms']:.0f}/{alone['ttft_p90_ms']:.0f}/"
        f"{alone['ttft_p99_ms']:.0f}; with a batch running {busy['ttft_p50_ms']:.0f}/{busy['ttft_p90_ms']:.0f}/"
        f"{busy['ttft_p99_ms']:.0f} (p90 {busy['ttft_p90_ms'] / alone['ttft_p90_ms']:.2f}x alone; bound 2x + 100 ms "
        f"= {2 * alone['ttft_p90_ms'] + 100:.0f} ms; batch still running after: {busy['batch_still_running']})",
        f"resume after SIGKILL: {res['done_before_kill']} lines done before; ready {res['ready_s']:.1f} s, first new "
        f"line {res['first_new_line_s']:.1f} s, completed {res['completed_s']:.1f} s after the restart; "
        f"{res['status']}, every custom_id once: {res['custom_ids_once']}",
    ])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lines", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=16, help="batches.lines_in_flight, and the online load's")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--interactive", type=int, default=20)
    p.add_argument("--interactive-tokens", type=int, default=16)
    p.add_argument("--port", type=int, default=8152)
    p.add_argument("--ready-timeout", type=float, default=600)
    p.add_argument("--out", help="write the results as JSON here")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    workdir = Path("/tmp/tandem-bench-batch")
    if workdir.exists():
        import shutil

        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    result = run(args, workdir)
    print(report(result), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
