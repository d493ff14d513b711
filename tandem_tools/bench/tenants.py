"""Many tenants on one replica (issue 33): an interactive key's TTFT alone, under a flood of bulk
streams at a lower priority, and under the same flood at its own priority (what first come, first
served costs); two tenants of weights 1 and 3 flooding together, and the weight-1 tenant alone.
One `tandem serve` per model kind (tiny-llama, tiny-diffusiongemma), one alive at a time.

    python -m tandem_tools.bench.tenants            (or: tandem bench --mode tenants)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

import httpx
import yaml

from tandem_tools.bench import procstat
from tandem_tools.bench.common import per_model
from tandem_tools.bench.loadgen import one_stream, percentile
from tandem_tools.bench.servers import Server, prompts

REPO = Path(__file__).resolve().parents[2]
logger = logging.getLogger("tandem.bench")
KEYS = {"interactive": ("sk-bench-interactive", {"tenant": "interactive"}),
        "bulk": ("sk-bench-bulk", {"tenant": "bulk", "priority": 10}),
        "bulk-fifo": ("sk-bench-bulk-fifo", {"tenant": "bulk"}),
        "light": ("sk-bench-light", {"tenant": "light", "weight": 1}),
        "heavy": ("sk-bench-heavy", {"tenant": "heavy", "weight": 3})}
MODELS = {
    "tiny-llama": {"kind": "autoregressive", "source": "builtin:tiny-llama", "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
                   "engine_args": {"enforce_eager": True, "max_model_len": 512, "dtype": "float32"}},
    "tiny-diffusiongemma": {"kind": "diffusion", "source": "builtin:tiny-diffusiongemma",
                            "engine_args": {"max_batch": 4}},
}


def config(model: str, port: int, max_in_flight: int) -> dict:
    return {"gateway": {"port": port}, "ray": {"num_cpus": 2}, "models_dir": str(REPO / "models"),
            "auth": {"api_keys": [{"key": k, "name": name, **extra} for name, (k, extra) in KEYS.items()]},
            "models": [{"name": model, "replicas": 1, "resources": {"num_gpus": 0, "num_cpus": 1},
                        "max_in_flight_per_replica": max_in_flight, **MODELS[model]}]}


def _body(model: str, prompt: str, max_tokens: int) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}


class Load:
    """Streams of one key kept busy until ``stop``; completed requests and tokens counted."""

    def __init__(self, url: str, key: str, model: str, streams: int, max_tokens: int):
        self.url, self.key, self.model, self.streams, self.max_tokens = url, key, model, streams, max_tokens
        self.done = self.tokens = self.errors = 0
        self.stop = asyncio.Event()

    async def run(self) -> None:
        headers = {"Authorization": f"Bearer {KEYS[self.key][0]}"}
        async with httpx.AsyncClient(timeout=600, headers=headers,
                                     limits=httpx.Limits(max_connections=self.streams + 2)) as client:
            async def stream(i: int) -> None:
                texts = prompts(64, seed=i)
                n = 0
                while not self.stop.is_set():
                    r = await one_stream(client, self.url, _body(self.model, texts[n % 64], self.max_tokens))
                    n += 1
                    if self.stop.is_set():
                        return
                    if r.ok:
                        self.done += 1
                        self.tokens += r.output_tokens
                    else:
                        self.errors += 1
            await asyncio.gather(*(stream(i) for i in range(self.streams)))


async def interactive(url: str, model: str, n: int, max_tokens: int) -> dict:
    """``n`` streams one after another (an interactive user): TTFT percentiles."""
    headers = {"Authorization": f"Bearer {KEYS['interactive'][0]}"}
    ttfts, errors = [], 0
    async with httpx.AsyncClient(timeout=600, headers=headers) as client:
        for text in prompts(n, seed=1000):
            r = await one_stream(client, url, _body(model, text, max_tokens))
            if r.ok:
                ttfts.append(r.ttft_s * 1000)
            else:
                errors += 1
    return {"ttft_p50_ms": percentile(ttfts, 0.5), "ttft_p90_ms": percentile(ttfts, 0.9),
            "ttft_p99_ms": percentile(ttfts, 0.99), "n": len(ttfts), "errors": errors}


async def with_flood(url: str, model: str, key: str, args) -> dict:
    flood = Load(url, key, model, args.flood_streams, args.flood_tokens)
    task = asyncio.create_task(flood.run())
    await asyncio.sleep(args.settle_s)  # the flood fills the replica and the queue first
    result = await interactive(url, model, args.interactive, args.interactive_tokens)
    flood.stop.set()
    await task
    return {**result, "flood_done": flood.done, "flood_errors": flood.errors}


async def shares(url: str, model: str, args) -> dict:
    loads = {k: Load(url, k, model, args.share_streams, args.share_tokens) for k in ("light", "heavy")}
    tasks = [asyncio.create_task(x.run()) for x in loads.values()]
    await asyncio.sleep(args.settle_s)
    base = {k: (x.done, x.tokens) for k, x in loads.items()}
    await asyncio.sleep(args.share_s)
    got = {k: (x.done - base[k][0], x.tokens - base[k][1]) for k, x in loads.items()}
    for x in loads.values():
        x.stop.set()
    await asyncio.gather(*tasks)
    alone = Load(url, "light", model, args.share_streams, args.share_tokens)
    task = asyncio.create_task(alone.run())
    await asyncio.sleep(args.settle_s)
    before = alone.done
    await asyncio.sleep(args.share_s)
    alone_done = alone.done - before
    alone.stop.set()
    await task
    both = sum(d for d, _ in got.values())
    return {"light_done": got["light"][0], "heavy_done": got["heavy"][0],
            "heavy_to_light_requests": got["heavy"][0] / max(1, got["light"][0]),
            "heavy_to_light_tokens": got["heavy"][1] / max(1, got["light"][1]),
            "light_alone_done": alone_done, "light_alone_vs_both": alone_done / max(1, both),
            "errors": sum(x.errors for x in loads.values()) + alone.errors}


def run_model(model: str, args, workdir: Path) -> dict:
    cfg_path = workdir / f"{model}.yaml"
    cfg_path.write_text(yaml.safe_dump(config(model, args.port, args.max_in_flight)))
    tandem = str(Path(sys.executable).parent / "tandem")
    with Server(f"tandem-{model}", [tandem, "serve", "--config", str(cfg_path)], args.port, f"/ready?model={model}",
                workdir / f"{model}.log", dict(os.environ)) as server:
        server.wait_ready(args.ready_timeout)
        url = f"http://127.0.0.1:{args.port}/v1/chat/completions"
        cpu0 = sum(procstat.cpu_s(p) for p in procstat.tree(server.proc.pid) if "tandem" in procstat.cmdline(p))
        out = {"alone": asyncio.run(interactive(url, model, args.interactive, args.interactive_tokens))}
        out["bulk_at_priority_10"] = asyncio.run(with_flood(url, model, "bulk", args))
        out["bulk_at_same_priority"] = asyncio.run(with_flood(url, model, "bulk-fifo", args))
        out["weights_1_3"] = asyncio.run(shares(url, model, args))
        out["gateway_cpu_s"] = sum(procstat.cpu_s(p) for p in procstat.tree(server.proc.pid)
                                   if "tandem" in procstat.cmdline(p)) - cpu0
        usage = httpx.get(f"http://127.0.0.1:{args.port}/admin/usage", timeout=30,
                          headers={"Authorization": f"Bearer {KEYS['interactive'][0]}"})
        out["usage_route_for_a_user_key"] = usage.status_code  # 403: the admin routes are admins'
    return out


def report(model: str, r: dict) -> str:
    base = r["alone"]["ttft_p90_ms"]
    head = f"{'interactive TTFT':34} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'p90 / alone':>11}"
    lines = [f"\n== {model} ==", head]
    for name in ("alone", "bulk_at_priority_10", "bulk_at_same_priority"):
        x = r[name]
        lines.append(f"{name:34} {x['ttft_p50_ms']:8.0f} {x['ttft_p90_ms']:8.0f} {x['ttft_p99_ms']:8.0f} "
                     f"{x['ttft_p90_ms'] / base:11.2f}")
    w = r["weights_1_3"]
    lines.append(f"weights 1:3 flooding: heavy/light requests {w['heavy_to_light_requests']:.2f}, tokens "
                 f"{w['heavy_to_light_tokens']:.2f} ({w['heavy_done']}/{w['light_done']}); light alone gets "
                 f"{w['light_alone_vs_both']:.2f}x what both got together; errors {w['errors']}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default="tiny-llama,tiny-diffusiongemma")
    p.add_argument("--max-in-flight", type=int, default=4, help="max_in_flight_per_replica (default 4)")
    p.add_argument("--flood-streams", type=int, default=24)
    p.add_argument("--flood-tokens", type=int, default=64)
    p.add_argument("--interactive", type=int, default=20, help="interactive requests per phase")
    p.add_argument("--interactive-tokens", type=int, default=16)
    p.add_argument("--share-streams", type=int, default=16)
    p.add_argument("--share-tokens", type=int, default=16)
    p.add_argument("--share-s", type=float, default=30, help="seconds each shares phase is counted")
    p.add_argument("--settle-s", type=float, default=5, help="seconds a flood runs before it is measured")
    p.add_argument("--port", type=int, default=8151)
    p.add_argument("--ready-timeout", type=float, default=600)
    p.add_argument("--out", help="write the results as JSON here")


def main(argv: list[str] | None = None) -> int:
    return per_model(argv, __doc__, add_arguments, "/tmp/tandem-bench-tenants", run_model, report)


if __name__ == "__main__":
    sys.exit(main())
