"""`tandem bench --mode diffusion`: tandem's block-diffusion batcher against HF `generate()`.

In one run, on the same machine, the same mixed-length chat prompts:
- tandem: the batcher in a Ray actor behind the gateway, block boundaries and row boundaries;
- HF sequential: ``generate()`` one request at a time (what a naive server does); request
  latency is that of a FIFO server with ``c`` closed-loop clients;
- HF static batch: one ``generate()`` over ``c`` requests, with equal-length prompts (HF's
  batching needs one shared cache at one block index: the best case for it).
All at one torch thread (a Ray actor's default). Output tokens are counted up to max_tokens or
EOS for every target (HF returns whole canvases).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from pathlib import Path

import httpx
import yaml

from gateway.loadgen import percentile, run_level

logger = logging.getLogger("tandem.bench")
MODEL = "tiny-diffusiongemma"


def _texts(n: int, seed: int) -> list[str]:
    from gateway.bench import _prompts

    return _prompts(n, seed)


def _engine(url: str) -> dict:
    rows = httpx.get(url + "/admin/replicas", timeout=10).json()["replicas"]
    return next(r["engine"] for r in rows if r["model"] == MODEL)


def _tandem(args, model_path: str, workdir: Path, levels: list[int], boundaries: str) -> dict:
    from gateway.bench import Server

    cfg = {"gateway": {"host": "127.0.0.1", "port": args.port}, "ray": {"num_cpus": 2},
           "models": [{"name": MODEL, "kind": "diffusion", "source": model_path,
                       "resources": {"num_gpus": 0, "num_cpus": 1},
                       "engine_args": {"family": "diffusiongemma", "max_batch": max(levels),
                                       "boundaries": boundaries}}]}
    path = workdir / f"tandem-{boundaries}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    server = Server(f"tandem ({boundaries})", [sys.executable, "-m", "gateway.cli", "--log-level", "warning",
                                                "serve", "--config", str(path)],
                    args.port, "/ready", workdir / f"tandem-{boundaries}.log", dict(os.environ))
    out = {}
    url = f"http://127.0.0.1:{args.port}"
    with server:
        server.wait_ready(args.ready_timeout)
        asyncio.run(run_level(url, _bodies(2, 32, 99), 2))  # warm-up
        for c in levels:
            n = max(4, 2 * c)
            before, t0 = _engine(url), time.perf_counter()
            res = asyncio.run(run_level(url, _bodies(n, args.max_tokens, c), c))
            wall, after = time.perf_counter() - t0, _engine(url)
            d = {k: after[k] - before[k] for k in ("steps", "row_steps", "row_steps_waiting", "blocks_committed",
                                                   "tokens_committed", "forward_s", "busy_s")}
            out[c] = {
                "tokens_per_s": res.output_tokens_per_s, "latency_p50_ms": res.latency_p50_ms,
                "latency_p99_ms": res.latency_p99_ms, "first_block_p50_ms": res.ttft_p50_ms,
                "admission_wait_mean_ms": 1000 * (after["admission_wait_sum_s"] - before["admission_wait_sum_s"])
                / max(after["admitted"] - before["admitted"], 1),
                "tokens_per_forward": d["tokens_committed"] / max(d["steps"], 1),
                "forwards_per_block": d["row_steps"] / max(d["blocks_committed"], 1),
                "row_steps_waiting_share": d["row_steps_waiting"] / max(d["row_steps"] + d["row_steps_waiting"], 1),
                "outside_forward_share": max(0.0, 1 - d["forward_s"] / wall), "errors": res.errors,
            }
            logger.info("tandem %s c=%d: %.0f tok/s", boundaries, c, res.output_tokens_per_s)
    return out


def _bodies(n: int, max_tokens: int, seed: int) -> list[dict]:
    return [{"model": MODEL, "messages": [{"role": "user", "content": t}], "max_tokens": max_tokens,
             "stream": True, "stream_options": {"include_usage": True}, "seed": seed * 1000 + i}
            for i, t in enumerate(_texts(n, seed))]


def _hf(model_path: str, levels: list[int], max_tokens: int) -> tuple[dict, dict]:
    import torch
    from transformers import AutoTokenizer, DiffusionGemmaForBlockDiffusion

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_path)
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(model_path, dtype=torch.float32).eval()
    eos = {tok.convert_tokens_to_ids("<|im_end|>")}

    def count(row: list[int]) -> int:
        cut = next((i for i, t in enumerate(row) if t in eos), None)
        return min(cut if cut is not None else len(row), max_tokens)

    def ids(text: str) -> list[int]:
        return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False)

    model.generate(torch.tensor([ids("warm up")]), max_new_tokens=32)
    seq, static = {}, {}
    for c in levels:
        n = max(4, 2 * c)
        prompts = [ids(t) for t in _texts(n, c)]
        service, tokens = [], 0
        for p in prompts:
            t0 = time.perf_counter()
            out = model.generate(torch.tensor([p]), max_new_tokens=max_tokens).sequences[0, len(p):].tolist()
            service.append(time.perf_counter() - t0)
            tokens += count(out)
        latencies = _fifo_latencies(service, c)
        seq[c] = {"tokens_per_s": tokens / sum(service), "latency_p50_ms": percentile(latencies, 0.5) * 1000,
                  "latency_p99_ms": percentile(latencies, 0.99) * 1000}
        # Static batches of c equal-length prompts (the median length, truncated or repeated).
        length = sorted(len(p) for p in prompts)[len(prompts) // 2]
        equal = [(p * (length // len(p) + 1))[:length] for p in prompts]
        t_all, tokens, lat = 0.0, 0, []
        for i in range(0, n, c):
            batch = torch.tensor(equal[i:i + c])
            t0 = time.perf_counter()
            out = model.generate(batch, max_new_tokens=max_tokens).sequences[:, length:].tolist()
            dt = time.perf_counter() - t0
            t_all += dt
            lat += [t_all] * len(out)
            tokens += sum(count(r) for r in out)
        static[c] = {"tokens_per_s": tokens / t_all, "latency_p50_ms": percentile(lat, 0.5) * 1000,
                     "latency_p99_ms": percentile(lat, 0.99) * 1000}
        logger.info("HF c=%d: sequential %.0f tok/s, static batch %.0f tok/s", c, seq[c]["tokens_per_s"],
                    static[c]["tokens_per_s"])
    return seq, static


def _fifo_latencies(service: list[float], clients: int) -> list[float]:
    """Latency of each request at a one-at-a-time server with `clients` closed-loop clients."""
    free_at, ready = 0.0, [0.0] * clients  # when the server is free; when each client submits next
    out = []
    for i, s in enumerate(service):
        k = i % clients
        start = max(free_at, ready[k])
        free_at = start + s
        out.append(free_at - ready[k])
        ready[k] = free_at
    return out


def format_table(results: dict, levels: list[int]) -> str:
    cols = [("out tok/s", "tokens_per_s", "{:.0f}"), ("latency p50 ms", "latency_p50_ms", "{:.0f}"),
            ("latency p99 ms", "latency_p99_ms", "{:.0f}"), ("1st block p50 ms", "first_block_p50_ms", "{:.0f}"),
            ("admission wait mean ms", "admission_wait_mean_ms", "{:.0f}"),
            ("tokens/forward", "tokens_per_forward", "{:.2f}"), ("forwards/block", "forwards_per_block", "{:.1f}"),
            ("row-steps waiting", "row_steps_waiting_share", "{:.1%}"),
            ("outside forwards", "outside_forward_share", "{:.1%}")]
    names = list(results)
    lines = ["| conc | metric | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for c in levels:
        for label, key, fmt in cols:
            vals = [results[n].get(c, {}).get(key) for n in names]
            if all(v is None for v in vals):
                continue
            lines.append(f"| {c} | {label} | " + " | ".join("-" if v is None else fmt.format(v) for v in vals) + " |")
        base = results.get("hf sequential", {}).get(c, {}).get("tokens_per_s")
        stat = results.get("hf static batch", {}).get(c, {}).get("tokens_per_s")
        for n in names:
            if n.startswith("tandem") and base:
                t = results[n][c]["tokens_per_s"]
                lines.append(f"| {c} | {n} / sequential, / static | {t / base:.2f}x, "
                             f"{t / stat if stat else float('nan'):.2f}x | " + " | " * (len(names) - 1))
    return "\n".join(lines)


def main(args) -> int:
    import json
    import tempfile

    from workers import tiny_models

    logging.getLogger("httpx").setLevel(logging.WARNING)
    levels = [int(x) for x in (args.concurrency if args.concurrency != "1,8,32" else "1,4,8,16").split(",")]
    model_path = str(tiny_models.build(tiny_models.TINY_DIFFUSIONGEMMA))
    results: dict[str, dict] = {}
    # HF first: nothing of a server (Ray, its actor) is left running to take CPU from it.
    hf_seq, hf_static = _hf(model_path, levels, args.max_tokens)
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
        for b in ("block", "row"):
            results[f"tandem {b}"] = _tandem(args, model_path, Path(tmp), levels, b)
    results["hf sequential"], results["hf static batch"] = hf_seq, hf_static
    print(f"\nstreaming chat, {MODEL}, {args.max_tokens} output tokens/request, default diffusion settings\n")
    print(format_table(results, levels))
    if args.out:
        Path(args.out).write_text(json.dumps({"levels": levels, "results": results}, indent=1, default=str))
    return 0
