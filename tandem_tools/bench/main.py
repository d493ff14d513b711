"""`tandem bench`: tandem against its peers on the same machine, in one run, on vLLM's own load
generator (`vllm bench serve`).

Setups, one engine alive at a time (an idle vLLM busy-waits on most of a core, so two would
fight): ``direct`` (`vllm serve`), ``vllm-router`` and ``smg`` (the Rust gateways, each in front
of a `vllm serve`, one worker, round robin; `pip install tandem[bench]`), and ``tandem`` (same
model, same engine arguments). Rounds are interleaved (every setup once per round, the order
rotated each round) and each figure is the median over rounds; a ratio to direct is the median
of the per-round ratios (each pairs two runs close in time).

Besides `vllm bench serve`'s tok/s, TTFT and ITL, the CPU time of each setup's gateway process
(tandem's uvicorn process, the router's process) and of vLLM's serving layer (the `vllm serve`
API server; in tandem the replica actor) is read from /proc over the measured requests: the
wall clock of this shared 2-core box swings ~30%, CPU time per 1,000 tokens much less.

Servers start in a new process group of this session (a new *session* was seen to deliver
streams in bursts, ~10x worse TTFT).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from tandem_tools.bench import procstat
from tandem_tools.bench.otlp_sink import Sink
from tandem_tools.bench.setups import MODEL, TANDEM_RAY, TANDEM_TRACED, TARGETS, Setup, build_setups, missing_binaries
from tandem_tools.bench.vllm_bench import LevelResult, LevelSpec, run_level
from workers import tiny_models

logger = logging.getLogger("tandem.bench")
ALL_CORES = set(os.sched_getaffinity(0))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=["ar", "diffusion", "prefix", "diffusion-prefix", "tenants", "batch", "decisions"],
                   default="ar",
                   help="ar: tandem vs `vllm serve`, vllm-router and smg, load from `vllm bench serve` "
                        "(default); diffusion: tandem's batcher vs HF generate(); prefix: multi-tenant "
                        "prompts on 2 replicas under p2c, session affinity and prefix routing; "
                        "diffusion-prefix: the diffusion prefix cache on vs off (shape-diffusiongemma-deep); "
                        "tenants: priority and weighted shares on one replica (its own flags: python -m "
                        "tandem_tools.bench.tenants --help, passed after --mode tenants); batch: the Batch API "
                        "against the same requests online, interactive TTFT with a batch running, resume after a "
                        "kill (its own flags: python -m tandem_tools.bench.batch --help); decisions: /v1/decisions "
                        "with 1, 10 and 100 questions against the same questions as one-token chat completions "
                        "(its own flags: python -m tandem_tools.bench.decisions --help)")
    p.add_argument("--concurrency", default="1,8,32",
                   help="comma-separated levels (default: 1,8,32; diffusion mode: 1,4,8,16, and 1,4,MAX_BATCH "
                        "for the shape model)")
    p.add_argument("--requests", type=int, default=0,
                   help="requests per level (default: max(32, 4 x concurrency))")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default: 64)")
    p.add_argument("--input-len", type=int, default=32,
                   help="ar mode: prompt tokens per request, before the chat template (default: 32)")
    p.add_argument("--rounds", type=int, default=2,
                   help="ar mode: interleaved rounds, every setup once per round (default: 2)")
    p.add_argument("--targets", default=",".join(TARGETS),
                   help=f"ar mode: which setups to run (default: {','.join(TARGETS)}; also {TANDEM_RAY}: tandem "
                        "with gateway.channel: ray, the channel to the replica over Ray instead of a socket; "
                        f"{TANDEM_TRACED}: tandem tracing every request, gateway, replica and vLLM spans, to an "
                        "OTLP/HTTP sink in this process). Ratios are to direct, else to the first target")
    p.add_argument("--port", type=int, default=8123,
                   help="port for the server under test (default: 8123; a gateway's vLLM takes the next one)")
    p.add_argument("--out", help="also write the results as JSON to this file")
    p.add_argument("--ready-timeout", type=float, default=600, help="seconds to wait for a server to be ready")


# -- running --------------------------------------------------------------------------------
def num_prompts(requests: int, c: int) -> int:
    return requests or max(32, 4 * c)


def _client_cores() -> set[int] | None:
    """The load generator keeps off vLLM's pinned worker core, for every setup alike."""
    from workers.cpu_affinity import vllm_worker_cores

    allowed = ALL_CORES - vllm_worker_cores()
    return allowed if allowed and allowed != ALL_CORES else None


def _run_setup(setup: Setup, levels: list[int], args, model_path: str, workdir: Path,
               rnd: int) -> dict[int, LevelResult]:
    out: dict[int, LevelResult] = {}
    with ExitStack() as stack:
        for server in setup.servers:
            os.sched_setaffinity(0, ALL_CORES)  # a server inherits this process's cores
            stack.enter_context(server)
            server.wait_ready(args.ready_timeout)
        serving_pid = setup.serving()
        pids = {"serving": serving_pid}
        if setup.gateway:
            pids["gateway"] = setup.gateway.proc.pid
        if serving_pid is None:
            logger.warning("%s: vLLM's serving-layer process not found; its CPU is not reported", setup.name)
        pids = {k: v for k, v in pids.items() if v}

        def sample() -> dict[str, float]:
            return {k: procstat.cpu_s(pid) for k, pid in pids.items()}

        affinity = _client_cores()
        for c in levels:
            spec = LevelSpec(f"http://127.0.0.1:{args.port}", MODEL, model_path, c, num_prompts(args.requests, c),
                             args.input_len, args.max_tokens, seed=c)
            res = run_level(spec, workdir, sample, f"r{rnd}-{setup.name}-c{c}", affinity=affinity)
            logger.info("round %d %s c=%d: %.0f tok/s, TTFT p50 %.1f ms, ITL p50 %.2f ms, %d failed, CPU ms/1k tok %s",
                        rnd, setup.name, c, res.output_tok_s, res.ttft_p50_ms, res.itl_p50_ms, res.failed,
                        {k: round(res.cpu_ms_per_1k_tokens(k) or 0) for k in res.cpu_s})
            out[c] = res
    return out


def round_order(targets: list[str], rnd: int) -> list[str]:
    """Every target once per round, rotated so that no target always runs first (or last)."""
    k = rnd % len(targets) if targets else 0
    return targets[k:] + targets[:k]


# -- the table ------------------------------------------------------------------------------
Rounds = list[dict[int, LevelResult]]  # one {concurrency: result} per round


def _front_cpu(r: LevelResult) -> float | None:
    """Gateway + vLLM's serving layer, ms per 1,000 tokens: all but the engine core."""
    parts = [r.cpu_ms_per_1k_tokens(k) for k in ("gateway", "serving") if k in r.cpu_s]
    return sum(parts) if parts and "serving" in r.cpu_s else None


METRICS: list[tuple[str, Callable[[LevelResult], float | None], str, bool]] = [
    # label, value, format, ratio to direct
    ("out tok/s", lambda r: r.output_tok_s, "{:,.0f}", True),
    ("TTFT p50 ms", lambda r: r.ttft_p50_ms, "{:.1f}", True),
    ("TTFT p99 ms", lambda r: r.ttft_p99_ms, "{:.1f}", True),
    ("ITL p50 ms", lambda r: r.itl_p50_ms, "{:.2f}", True),
    ("gateway CPU ms/request", lambda r: r.cpu_ms_per_request("gateway"), "{:.2f}", False),
    ("serving CPU ms/request", lambda r: r.cpu_ms_per_request("serving"), "{:.2f}", False),
    ("gateway CPU ms/1k tok", lambda r: r.cpu_ms_per_1k_tokens("gateway"), "{:.0f}", False),
    ("gateway+serving CPU ms/1k tok", _front_cpu, "{:.0f}", True),
]


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None and v == v]
    return statistics.median(vals) if vals else None


def summarize(results: dict[str, Rounds], levels: list[int], baseline: str = "direct") -> dict:
    """{target: {c: {label: (median value, median ratio to baseline or None)}}}."""
    out: dict = {}
    for target, rounds in results.items():
        out[target] = {}
        for c in levels:
            row = {}
            for label, fn, _, with_ratio in METRICS:
                vals = [fn(r[c]) for r in rounds if c in r]
                ratios = []
                if with_ratio and target != baseline:
                    for i, r in enumerate(rounds):
                        base = results.get(baseline, [])
                        if c in r and i < len(base) and c in base[i]:
                            v, b = fn(r[c]), fn(base[i][c])
                            ratios.append(v / b if v is not None and b else None)
                row[label] = (_median(vals), _median(ratios))
            row["failed"] = sum(r[c].failed for r in rounds if c in r)
            out[target][c] = row
    return out


def format_table(results: dict[str, Rounds], levels: list[int]) -> str:
    """Ratios are to ``direct`` (`vllm serve`), else to the first target."""
    targets = list(results)
    summary = summarize(results, levels, "direct" if "direct" in results else targets[0])
    lines = ["| c | metric | " + " | ".join(targets) + " |", "|---|---|" + "---|" * len(targets)]
    for c in levels:
        for label, _, fmt, _ in METRICS:
            cells = []
            for t in targets:
                value, ratio = summary[t][c][label]
                cell = "-" if value is None else fmt.format(value)
                if value is not None and ratio is not None:
                    cell += f" ({ratio:.2f}x)"
                cells.append(cell)
            if any(cell != "-" for cell in cells):
                lines.append(f"| {c} | {label} | " + " | ".join(cells) + " |")
        failed = [f"{t}: {summary[t][c]['failed']}" for t in targets if summary[t][c]["failed"]]
        if failed:
            lines.append(f"| {c} | failed requests | " + ", ".join(failed) + " |" + " |" * (len(targets) - 1))
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    levels = [int(x) for x in args.concurrency.split(",")]
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    known = [*TARGETS, TANDEM_RAY, TANDEM_TRACED]
    unknown = sorted(set(targets) - set(known))
    if unknown:
        print(f"tandem bench: unknown target(s) {', '.join(unknown)}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    missing = missing_binaries(targets)
    if missing:
        print(f"tandem bench: {', '.join(missing)} not installed (pip install 'tandem[bench]'); skipping",
              file=sys.stderr)
        targets = [t for t in targets if t not in missing]
    model_path = str(tiny_models.build(tiny_models.TINY_LLAMA))
    results: dict[str, Rounds] = {t: [] for t in targets}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp, ExitStack() as stack:
        sink = stack.enter_context(Sink()) if TANDEM_TRACED in targets else None
        args.otlp_endpoint = sink.endpoint if sink else None
        setups = build_setups(args, model_path, Path(tmp))
        for rnd in range(args.rounds):
            for name in round_order(targets, rnd):
                results[name].append(_run_setup(setups[name], levels, args, model_path, Path(tmp), rnd))
    table = format_table(results, levels)
    print(f"\nstreaming chat ({MODEL}, `vllm bench serve`, random dataset, {args.input_len} prompt tokens, "
          f"{args.max_tokens} output tokens, ignore_eos), medians of {args.rounds} interleaved rounds, "
          f"{time.monotonic() - t0:.0f} s\n")
    print(table)
    if sink is not None:
        print(f"\n{TANDEM_TRACED}: {sink.spans:,} spans received by the OTLP sink")
    if args.out:
        Path(args.out).write_text(json.dumps(
            {"levels": levels, "rounds": args.rounds, "input_len": args.input_len, "max_tokens": args.max_tokens,
             "targets": targets, "table": table,
             "results": {t: [{c: r.as_dict() for c, r in rnd.items()} for rnd in v] for t, v in results.items()}},
            indent=1))
    return 0
