"""`tandem bench --mode prefix`: what routing does to the engines' prefix caches (issue 16).

Many tenants, each with a long system prompt of its own and a short question, interleaved (every
tenant once per round, in a shuffled order, the same order for every setup), streamed at a fixed
concurrency against tandem with two tiny-llama replicas, under each routing in one run (one
tandem at a time): ``p2c`` (power of two choices on load), ``affinity`` (session affinity,
``x-session-id`` = the tenant) and ``prefix`` (``routing: prefix``).

Reported per setup: vLLM's own prefix-cache hit rate per replica (``prefix_cache_hits`` /
``prefix_cache_queries``, tokens, from its scheduler stats, read through /admin/replicas before
and after the load), the prompt tokens the engines computed (queries - hits: the prefill work,
a figure this noisy shared box reproduces where wall-clock does not), TTFT p50/p99, and requests
per replica (the largest share, next to the load bound).

``--kind diffusion``: the same load on two ``tiny-diffusiongemma`` replicas (fast sampler, its
prefix cache on; 4 denoising steps a block) under ``p2c`` and ``prefix`` (diffusion models have no
session affinity); the counters are the diffusion engine's own, under the same names. Its page
pool holds every tenant's prompt here (no ``--kv-tokens`` for it): what routing changes is how
many replicas compute each tenant's prompt once.

Each replica's KV cache is made small on purpose (``--kv-tokens``, via vLLM's
``num_gpu_blocks_override``): with a cache that holds every tenant's prompt, any routing hits
after each replica has seen each tenant once; the routing matters when the tenants' prompts do
not all fit in one replica's cache but do fit in all of them together.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from tandem_tools.bench import procstat
from tandem_tools.bench.loadgen import percentile
from tandem_tools.bench.servers import Server, prompts
from workers import tiny_models

logger = logging.getLogger("tandem.bench")
MODEL = "tiny-llama"
DIFFUSION_MODEL = "tiny-diffusiongemma"
ROUTINGS = ("p2c", "affinity", "prefix")
CHARS_PER_TOKEN = 3.86  # tiny-llama's tokenizer on the corpus
BLOCK_SIZE = 32  # vLLM's KV block on CPU (a multiple of 32)
REPLICA_HEADER = "x-tandem-replica"
SESSION_HEADER = "x-session-id"
LOAD_FACTOR = 1.25  # the router's default bound (affinity's and prefix's)


def add_arguments(p: argparse.ArgumentParser, standalone: bool = False) -> None:
    """The prefix mode's options. ``standalone``: also the ones `tandem bench` already has
    (--port, --out, --ready-timeout)."""
    g = p.add_argument_group("prefix mode (--mode prefix)")
    g.add_argument("--tenants", type=int, default=16, help="prefix mode: tenants, each with its own system prompt "
                   "(default: 16)")
    g.add_argument("--per-tenant", type=int, default=6, help="prefix mode: requests per tenant (default: 6)")
    g.add_argument("--system-tokens", type=int, default=1500, help="prefix mode: tokens of each tenant's system "
                   "prompt (default: 1500)")
    g.add_argument("--streams", type=int, default=4, help="prefix mode: requests in flight (default: 4)")
    g.add_argument("--answer-tokens", type=int, default=8, help="prefix mode: max_tokens per request (default: 8)")
    g.add_argument("--kv-tokens", type=int, default=16384, help="prefix mode: each replica's KV cache in tokens "
                   "(default: 16384: ~10 tenants' prompts)")
    g.add_argument("--routings", default=None, help=f"prefix mode: setups, in order (default: "
                   f"{','.join(ROUTINGS)}; diffusion: p2c,prefix)")
    g.add_argument("--kind", choices=("autoregressive", "diffusion"), default="autoregressive",
                   help=f"prefix mode: the model, {MODEL} (vLLM) or {DIFFUSION_MODEL} (the diffusion batcher, fast "
                   "sampler) (default: autoregressive)")
    if standalone:
        p.add_argument("--port", type=int, default=8123, help="port for tandem (default: 8123)")
        p.add_argument("--out", help="also write the results as JSON to this file")
        p.add_argument("--ready-timeout", type=float, default=600, help="seconds to wait for tandem to be ready")


# -- the load -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Request:
    tenant: int
    body: dict


def system_prompt(tenant: int, tokens: int) -> str:
    """A tenant's own system prompt of about ``tokens`` tokens; different from its first
    characters on (as tenants' prompts are), then corpus text."""
    head = f"Tenant {tenant:03d}. You are the assistant of organisation number {tenant}. "
    text = head
    seed = 1000 + tenant
    while len(text) < tokens * CHARS_PER_TOKEN:
        text += " ".join(prompts(8, seed=seed)) + " "
        seed += 100_000
    return text[:int(tokens * CHARS_PER_TOKEN)]


def workload(tenants: int, per_tenant: int, system_tokens: int, answer_tokens: int, seed: int = 0,
             kind: str = "autoregressive") -> list[Request]:
    """Round r: every tenant once, in a shuffled order; each question differs."""
    model, extra = (DIFFUSION_MODEL, {"diffusion": {"max_denoising_steps": 4}}) if kind == "diffusion" else (MODEL, {})
    rng = random.Random(seed)
    systems = [system_prompt(t, system_tokens) for t in range(tenants)]
    questions = prompts(tenants * per_tenant, seed=seed + 7)
    out = []
    for r in range(per_tenant):
        order = list(range(tenants))
        rng.shuffle(order)
        for t in order:
            q = questions[r * tenants + t][:120]
            out.append(Request(t, {"model": model, "stream": True, "max_tokens": answer_tokens, **extra,
                                   "messages": [{"role": "system", "content": systems[t]},
                                                {"role": "user", "content": f"Question {r}: {q}"}]}))
    return out


@dataclass
class Result:
    tenant: int
    ok: bool
    replica: str | None = None
    ttft_s: float = float("nan")
    error: str | None = None


async def _one(client: httpx.AsyncClient, url: str, req: Request) -> Result:
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url, json=req.body, headers={SESSION_HEADER: f"tenant-{req.tenant}"}) as r:
            replica = r.headers.get(REPLICA_HEADER)
            if r.status_code != 200:
                return Result(req.tenant, False, replica, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            first = None
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return Result(req.tenant, False, replica, error=str(event["error"])[:200])
                if first is None and event.get("choices"):
                    first = time.perf_counter()
            return Result(req.tenant, True, replica, (first or time.perf_counter()) - t0)
    except httpx.HTTPError as e:
        return Result(req.tenant, False, error=f"{type(e).__name__}: {e}")


async def send(base_url: str, requests: list[Request], streams: int, timeout_s: float) -> tuple[list[Result], float]:
    """Every request in order, ``streams`` in flight; (results, wall seconds)."""
    url = base_url + "/v1/chat/completions"
    todo = list(reversed(requests))
    results: list[Result] = []
    limits = httpx.Limits(max_connections=streams + 2, max_keepalive_connections=streams + 2)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        async def worker() -> None:
            while todo:
                results.append(await _one(client, url, todo.pop()))

        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(streams))), timeout_s)
        return results, time.perf_counter() - t0


# -- one setup ------------------------------------------------------------------------------
def tandem_config(routing: str, port: int, model_path: str, kv_tokens: int, kind: str = "autoregressive") -> dict:
    if kind == "diffusion":
        model = {"name": DIFFUSION_MODEL, "kind": "diffusion", "source": model_path, "replicas": 2,
                 "resources": {"num_gpus": 0, "num_cpus": 1}, "routing": routing,
                 "engine_args": {"sampler": "fast", "max_batch": 4, "prefix_cache": True}}
        return {"gateway": {"host": "127.0.0.1", "port": port, "health_interval_s": 5, "health_timeout_s": 30},
                "ray": {"num_cpus": 2}, "models": [model]}
    model = {
        "name": MODEL, "kind": "autoregressive", "source": model_path, "replicas": 2,
        "resources": {"num_gpus": 0, "num_cpus": 1},
        "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"},  # tiny-llama's positions: 1024
        "engine_args": {"enforce_eager": True, "max_model_len": 2048, "max_num_seqs": 64, "dtype": "float32",
                        "enable_prefix_caching": True, "block_size": BLOCK_SIZE,
                        "num_gpu_blocks_override": max(1, kv_tokens // BLOCK_SIZE)},
        "routing": "prefix" if routing == "prefix" else "p2c",
    }
    if routing == "affinity":
        model["session_affinity"] = {"enabled": True, "header": SESSION_HEADER, "load_factor": LOAD_FACTOR}
    return {"gateway": {"host": "127.0.0.1", "port": port, "health_interval_s": 5, "health_timeout_s": 30},
            "ray": {"num_cpus": 2}, "models": [model]}


def replica_counters(base_url: str) -> dict[str, dict]:
    rows = httpx.get(base_url + "/admin/replicas", timeout=30).json()["replicas"]
    out = {}
    for row in rows:
        engine = row.get("engine") or {}
        out[row["id"]] = {k: engine.get(k, 0) for k in ("prefix_cache_queries", "prefix_cache_hits", "prompt_tokens")}
        out[row["id"]]["kv_cache_tokens"] = engine.get("kv_cache_tokens")
    return out


@dataclass
class SetupResult:
    routing: str
    wall_s: float
    cpu_s: float  # the whole tandem process tree (vLLM busy-waits: mostly wall x cores)
    results: list[Result]
    counters: dict[str, dict] = field(default_factory=dict)  # per replica: deltas over the load

    def summary(self) -> dict:
        ok = [r for r in self.results if r.ok]
        per_replica = {rid: sum(1 for r in ok if r.replica == rid) for rid in sorted(self.counters)}
        queries = sum(c["prefix_cache_queries"] for c in self.counters.values())
        hits = sum(c["prefix_cache_hits"] for c in self.counters.values())
        return {
            "routing": self.routing,
            "requests": len(self.results),
            "failed": len(self.results) - len(ok),
            "hit_rate": hits / queries if queries else float("nan"),
            "hit_rate_per_replica": {rid: (c["prefix_cache_hits"] / c["prefix_cache_queries"]
                                           if c["prefix_cache_queries"] else float("nan"))
                                     for rid, c in sorted(self.counters.items())},
            "computed_prompt_tokens_per_request": (queries - hits) / len(ok) if ok else float("nan"),
            "ttft_p50_ms": percentile([r.ttft_s for r in ok], 0.5) * 1000,
            "ttft_p99_ms": percentile([r.ttft_s for r in ok], 0.99) * 1000,
            "requests_per_replica": per_replica,
            "max_share": max(per_replica.values()) / len(ok) if ok and per_replica else float("nan"),
            "tenants_per_replica": {rid: len({r.tenant for r in ok if r.replica == rid}) for rid in per_replica},
            "kv_cache_tokens": {rid: c["kv_cache_tokens"] for rid, c in sorted(self.counters.items())},
            "wall_s": self.wall_s,
            "cpu_s_per_request": self.cpu_s / len(ok) if ok else float("nan"),
            "errors": sorted({r.error for r in self.results if r.error})[:5],
        }


def run_setup(routing: str, args, model_path: str, workdir: Path, load: list[Request]) -> SetupResult:
    cfg = workdir / f"tandem-{routing}.yaml"
    cfg.write_text(yaml.safe_dump(tandem_config(routing, args.port, model_path, args.kv_tokens, args.kind)))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    server = Server(f"tandem ({routing})", [sys.executable, "-m", "tandem_tools.cli", "--log-level", "warning",
                                            "serve", "--config", str(cfg)],
                    args.port, "/ready", workdir / f"tandem-{routing}.log", env)
    base = f"http://127.0.0.1:{args.port}"
    with server:
        try:
            server.wait_ready(args.ready_timeout)
        except RuntimeError as e:  # the temporary directory and its log go with the run: show the tail
            tail = "\n".join(server.log.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"{e}\n{tail}") from None
        before = replica_counters(base)
        cpu0 = sum(procstat.cpu_s(p) for p in procstat.tree(server.proc.pid))
        results, wall = asyncio.run(send(base, load, args.streams, timeout_s=args.ready_timeout))
        cpu1 = sum(procstat.cpu_s(p) for p in procstat.tree(server.proc.pid))
        after = replica_counters(base)
    counters = {rid: {k: (v - before.get(rid, {}).get(k, 0) if k != "kv_cache_tokens" else v)
                      for k, v in c.items()} for rid, c in after.items()}
    return SetupResult(routing, wall, cpu1 - cpu0, results, counters)


def format_table(summaries: list[dict]) -> str:
    names = [s["routing"] for s in summaries]
    rows = [
        ("prefix-cache hit rate (engines, all replicas)", lambda s: f"{s['hit_rate']:.1%}"),
        ("hit rate per replica", lambda s: " / ".join(f"{v:.1%}" for v in s["hit_rate_per_replica"].values())),
        ("prompt tokens computed per request", lambda s: f"{s['computed_prompt_tokens_per_request']:.0f}"),
        ("TTFT p50 ms", lambda s: f"{s['ttft_p50_ms']:.0f}"),
        ("TTFT p99 ms", lambda s: f"{s['ttft_p99_ms']:.0f}"),
        ("requests per replica", lambda s: " / ".join(str(v) for v in s["requests_per_replica"].values())),
        ("max share of requests", lambda s: f"{s['max_share']:.1%}"),
        ("tenants per replica", lambda s: " / ".join(str(v) for v in s["tenants_per_replica"].values())),
        ("KV cache tokens per replica (engines)", lambda s: " / ".join(str(v) for v in s["kv_cache_tokens"].values())),
        ("wall s", lambda s: f"{s['wall_s']:.0f}"),
        ("CPU s per request (all processes)", lambda s: f"{s['cpu_s_per_request']:.2f}"),
        ("failed", lambda s: str(s["failed"])),
    ]
    lines = ["| metric | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    lines += [f"| {label} | " + " | ".join(fn(s) for s in summaries) + " |" for label, fn in rows]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    diffusion = args.kind == "diffusion"
    known = ("p2c", "prefix") if diffusion else ROUTINGS
    routings = [r.strip() for r in (args.routings or ",".join(known)).split(",") if r.strip()]
    unknown = sorted(set(routings) - set(known))
    if unknown:
        print(f"tandem bench: routing(s) {', '.join(unknown)} not for a {args.kind} model; known: {', '.join(known)}",
              file=sys.stderr)
        return 2
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    model_path = str(tiny_models.build(tiny_models.TINY_DIFFUSIONGEMMA if diffusion else tiny_models.TINY_LLAMA))
    load = workload(args.tenants, args.per_tenant, args.system_tokens, args.answer_tokens, kind=args.kind)
    t0 = time.monotonic()
    summaries = []
    with tempfile.TemporaryDirectory(prefix="tandem-bench-prefix-") as tmp:
        for routing in routings:
            res = run_setup(routing, args, model_path, Path(tmp), load)
            s = res.summary()
            logger.info("%s: hit rate %.1f%%, TTFT p50 %.0f ms, per replica %s, %d failed", routing,
                        100 * s["hit_rate"], s["ttft_p50_ms"], s["requests_per_replica"], s["failed"])
            summaries.append(s)
    table = format_table(summaries)
    name = DIFFUSION_MODEL if diffusion else MODEL
    print(f"\nprefix routing ({name}, 2 replicas, {args.tenants} tenants x {args.per_tenant} requests, "
          f"~{args.system_tokens}-token system prompts, {args.streams} streams, {args.answer_tokens} output tokens, "
          f"KV cache {args.kv_tokens} tokens per replica, load bound {LOAD_FACTOR} x average), "
          f"{time.monotonic() - t0:.0f} s\n")
    print(table)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "func"},
                                              "summaries": summaries, "table": table}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m tandem_tools.bench.prefix", description=__doc__.split("\n")[0])
    parser.add_argument("--log-level", default="info")
    add_arguments(parser, standalone=True)
    ns = parser.parse_args()
    logging.basicConfig(level=getattr(logging, ns.log_level.upper()), format="%(asctime)s %(levelname)s %(message)s")
    sys.exit(main(ns))
