"""`tandem bench`: the same streaming chat load against tandem and against its peer
(`vllm serve` on the same model, same engine arguments, same machine), in one run, one
server at a time (on a small box they would otherwise fight for the same cores).

Servers start in a new process group of this session (a new *session* was seen to deliver
streams in bursts, ~10x worse TTFT); the load comes from ``tandem_tools.loadgen`` (httpx).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

import yaml

from tandem_tools.loadgen import LevelResult, run_level
from tandem_tools.servers import Server, prompts
from workers import tiny_models

logger = logging.getLogger("tandem.bench")
ENGINE_ARGS = {"enforce_eager": True, "max_model_len": 512, "max_num_seqs": 64, "dtype": "float32"}
ALL_CORES = set(os.sched_getaffinity(0))
CORPUS = Path(__file__).resolve().parent.parent / "workers" / "data" / "corpus.txt"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=["ar", "diffusion"], default="ar",
                   help="ar: tandem vs `vllm serve` (default); diffusion: tandem's batcher vs HF generate()")
    p.add_argument("--concurrency", default="1,8,32",
                   help="comma-separated levels (default: 1,8,32; diffusion mode: 1,4,8,16, and 1,4,MAX_BATCH "
                        "for the shape model)")
    p.add_argument("--requests", type=int, default=0,
                   help="requests per level (default: max(16, 4 x concurrency))")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default: 64)")
    p.add_argument("--targets", default="tandem,direct", help="which servers to run (default: tandem,direct)")
    p.add_argument("--port", type=int, default=8123, help="port for the server under test (default: 8123)")
    p.add_argument("--out", help="also write the results as JSON to this file")
    p.add_argument("--ready-timeout", type=float, default=600, help="seconds to wait for a server to be ready")


def _bodies(n: int, max_tokens: int, seed: int) -> list[dict]:
    return [{"model": "tiny-llama", "messages": [{"role": "user", "content": p}], "max_tokens": max_tokens,
             "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0}
            for p in prompts(n, seed)]


def _vllm_flags(engine_args: dict) -> list[str]:
    flags = []
    for k, v in engine_args.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            flags.append(flag)
        elif v is not False:
            flags += [flag, str(v)]
    return flags


def _servers(args, model_path: str, workdir: Path) -> dict[str, Server]:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    cfg = {
        "gateway": {"host": "127.0.0.1", "port": args.port},
        "ray": {"num_cpus": 2},
        "models": [{"name": "tiny-llama", "kind": "autoregressive", "source": model_path,
                    "resources": {"num_gpus": 0, "num_cpus": 1}, "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
                    "engine_args": ENGINE_ARGS}],
    }
    cfg_path = workdir / "tandem.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    tandem = Server("tandem", [sys.executable, "-m", "tandem_tools.cli", "--log-level", "warning", "serve",
                               "--config", str(cfg_path)], args.port, "/ready", workdir / "tandem.log", env)
    direct = Server("direct", [sys.executable, "-m", "tandem_tools.vllm_cli_shim", "serve", model_path,
                               "--served-model-name", "tiny-llama", "--host", "127.0.0.1", "--port", str(args.port),
                               "--disable-uvicorn-access-log", *_vllm_flags(ENGINE_ARGS)],
                    args.port, "/v1/models", workdir / "direct.log", env)
    return {"tandem": tandem, "direct": direct}


def _run_target(server: Server, levels: list[int], args) -> dict[int, LevelResult]:
    from workers.cpu_affinity import keep_off_vllm_workers

    out = {}
    with server:
        server.wait_ready(args.ready_timeout)
        # The load generator keeps off vLLM's pinned worker core for both targets alike.
        for tid in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(tid), ALL_CORES)
        keep_off_vllm_workers()
        url = f"http://127.0.0.1:{server.port}"
        asyncio.run(run_level(url, _bodies(8, 8, seed=99), 4))  # warm-up
        for c in levels:
            n = args.requests or max(16, 4 * c)
            res = asyncio.run(run_level(url, _bodies(n, args.max_tokens, seed=c), c))
            logger.info("%s c=%d: %.1f tok/s, TTFT p50 %.0f ms, %d errors", server.name, c,
                        res.output_tokens_per_s, res.ttft_p50_ms, res.errors)
            out[c] = res
    return out


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def format_table(results: dict[str, dict[int, LevelResult]], levels: list[int]) -> str:
    cols = [("req/s", "requests_per_s", "{:.2f}"), ("out tok/s", "output_tokens_per_s", "{:.0f}"),
            ("TTFT p50 ms", "ttft_p50_ms", "{:.0f}"), ("TTFT p99 ms", "ttft_p99_ms", "{:.0f}"),
            ("ITL p50 ms", "itl_p50_ms", "{:.1f}")]
    lines = ["| conc | metric | tandem | direct (vllm serve) | tandem/direct |", "|---|---|---|---|---|"]
    for c in levels:
        t, d = results.get("tandem", {}).get(c), results.get("direct", {}).get(c)
        for label, attr, fmt in cols:
            tv = getattr(t, attr) if t else None
            dv = getattr(d, attr) if d else None
            lines.append(f"| {c} | {label} | {fmt.format(tv) if tv is not None else '-'} | "
                         f"{fmt.format(dv) if dv is not None else '-'} | "
                         f"{_ratio(tv, dv) if tv is not None and dv is not None else '-'} |")
        errs = [f"{k}: {r[c].errors}" for k, r in results.items() if c in r and r[c].errors]
        if errs:
            lines.append(f"| {c} | errors | {', '.join(errs)} | | |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    levels = [int(x) for x in args.concurrency.split(",")]
    targets = [t.strip() for t in args.targets.split(",")]
    model_path = str(tiny_models.build(tiny_models.TINY_LLAMA))
    results: dict[str, dict[int, LevelResult]] = {}
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
        servers = _servers(args, model_path, Path(tmp))
        for name in targets:
            results[name] = _run_target(servers[name], levels, args)
    table = format_table(results, levels)
    print(f"\nstreaming chat, tiny-llama, {args.max_tokens} output tokens/request, ignore_eos\n")
    print(table)
    if args.out:
        Path(args.out).write_text(json.dumps(
            {"levels": levels, "max_tokens": args.max_tokens,
             "results": {k: {c: r.as_dict() for c, r in v.items()} for k, v in results.items()}}, indent=1))
    return 0
