"""`tandem bench --mode diffusion`: tandem's block-diffusion batcher against HF `generate()`.

In one run, on the same machine, the same mixed-length chat prompts:
- HF sequential: ``generate()`` one request at a time (what a naive server does); request
  latency is that of a FIFO server with ``c`` closed-loop clients;
- HF static batch: one ``generate()`` over ``c`` requests, with equal-length prompts (HF's
  batching needs one shared cache at one block index: the best case for it);
- tandem: the batcher in a Ray actor behind the gateway, for each sampler (exact, fast) and each
  boundary mode (block, row), one server at a time.
All at one torch thread (a Ray actor's default). HF runs in a child process of its own (its
memory and CPU time are its own, and nothing of it is left when the servers run). Output tokens
are counted up to max_tokens or EOS for every target (HF returns whole canvases).

Per level: tokens/s, seconds per (batched) denoise step, the share of wall time outside model
forwards, CPU time per output token (tandem: every process of the server, and the replica alone,
from /proc; HF: the child's own), peak RSS growth per row (VmHWM after a reset, minus the RSS
before the level, over the concurrency) and the mean RSS growth per row while the level ran.
The box is shared and its wall clock swings: CPU time per token is the steadier figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import yaml

from tandem_tools.bench.loadgen import percentile, run_level
from tandem_tools.bench.servers import Server, prompts

logger = logging.getLogger("tandem.bench")
TINY = "tiny-diffusiongemma"
SHAPE = "shape-diffusiongemma"
CLK_TCK = os.sysconf("SC_CLK_TCK")
MB = 1 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The diffusion mode's own flags (``tandem bench --mode diffusion``)."""
    g = p.add_argument_group("diffusion mode")
    g.add_argument("--model", default=TINY,
                   help=f"built-in model ({TINY}, default; {SHAPE}: the real canvas and vocabulary) or a path; "
                        "a '-fast' suffix runs tandem's fast sampler only")
    g.add_argument("--samplers", default="exact,fast", help="tandem samplers to run (default: exact,fast)")
    g.add_argument("--boundaries", default="block,row", help="tandem boundary modes to run (default: block,row)")
    g.add_argument("--steps", type=int, default=0,
                   help="max_denoising_steps per request (default: the model's, 48; the shape model wants ~8)")
    g.add_argument("--max-batch", type=int, default=0, help="tandem's max_batch (default: the largest level)")
    g.add_argument("--memory-budget-gib", type=float, default=0,
                   help="tandem's engine_args.memory_budget_gib (default: the engine's own)")
    g.add_argument("--max-rss-gib", type=float, default=7.0,
                   help="skip an HF static batch whose estimated RSS exceeds this (default: 7)")
    g.add_argument("--no-hf", action="store_true", help="tandem targets only")
    g.add_argument("--no-counts", action="store_true",
                   help="skip the aten-op counts per fast step printed after the table (eager and device form; "
                        "the device form compiles each part of the step: minutes with a cold inductor cache)")
    g.add_argument("--device", default="cpu",
                   help="cpu (default) or cuda: HF's device, and tandem's engine_args.device with one GPU per "
                        "replica (HF's peak device memory per row from torch.cuda)")
    g.add_argument("--interleave", action="store_true",
                   help="levels outside, targets inside (a server start per level and target)")


# -- /proc ----------------------------------------------------------------------------------
def proc_cpu_s(pid: int, sys_only: bool = False) -> float:
    """utime + stime (or stime alone) of a process, all its threads, in seconds (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return 0.0
    stime = int(fields[12])  # fields 14 (utime) and 15 (stime) of stat(5), counted after "pid (comm)"
    return (stime if sys_only else int(fields[11]) + stime) / CLK_TCK


def tree_cpu_s(before: dict[int, float], pids) -> float:
    """The CPU seconds ``pids`` spent since ``before`` (pid -> ``proc_cpu_s`` then; a pid not in it
    started since). A process that ended in between is left out: its whole life's CPU must not be
    taken off the others'."""
    total = 0.0
    for p in pids:
        now = proc_cpu_s(p)
        if now or p not in before:
            total += max(0.0, now - before.get(p, 0.0))
    return total


def proc_tree(root: int) -> list[int]:
    """``root`` and every live descendant (the gateway, Ray's daemons, the replica actors)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def proc_mem(pid: int | str = "self") -> dict[str, int]:
    """VmRSS and VmHWM in bytes."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line[:5]] = int(line.split()[1]) * 1024
    except FileNotFoundError:
        pass
    return out


def reset_peak(pid: int | str = "self") -> bool:
    """Reset VmHWM to the current RSS (Linux: ``echo 5 > /proc/PID/clear_refs``)."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class RssSampler:
    """Mean RSS of a process while a level runs (a thread, every ``period`` seconds)."""

    def __init__(self, pid: int | str, period: float = 0.5):
        self.pid, self.period, self.samples = pid, period, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = proc_mem(self.pid).get("VmRSS")
            if rss:
                self.samples.append(rss)
            self._stop.wait(self.period)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def mean(self) -> float:
        return sum(self.samples) / len(self.samples) if self.samples else float("nan")


class EngineSampler(RssSampler):
    """The engine's memory figures while a level runs (GET /admin/replicas every ``period`` s): the
    most reserved per running sequence, and the most sequences waiting for memory at once."""

    def __init__(self, url: str, model: str, period: float = 2.0):
        super().__init__(0, period)
        self.url, self.model = url, model

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                try:
                    rows = client.get(self.url + "/admin/replicas").json()["replicas"]
                    engine = next(r["engine"] for r in rows if r["model"] == self.model and "engine" in r)
                    self.samples.append(engine)
                except (httpx.HTTPError, StopIteration, KeyError, ValueError):
                    pass
                self._stop.wait(self.period)

    def summary(self) -> dict:
        per_row = [e["memory_reserved_bytes"] / e["running"] for e in self.samples
                   if e.get("memory_reserved_bytes") and e.get("running")]
        waiting = [e["waiting_for_memory"] for e in self.samples if "waiting_for_memory" in e]
        out = {}
        if per_row:
            out["reserved_per_row_mb"] = max(per_row) / MB
        if waiting:
            out["waiting_for_memory_max"] = max(waiting)
        return out


def memory_per_row(before_rss: int, peak: int, mean_rss: float, rows: int) -> dict:
    rows = max(rows, 1)
    return {"rss_before_mb": before_rss / MB, "peak_growth_per_row_mb": max(0, peak - before_rss) / rows / MB,
            "mean_growth_per_row_mb": max(0.0, mean_rss - before_rss) / rows / MB}


# -- the load -------------------------------------------------------------------------------
def _texts(n: int, seed: int) -> list[str]:

    return prompts(n, seed)


def num_requests(requests: int, c: int) -> int:
    """Requests at level ``c``: ``--requests`` (at least one round of ``c``), else max(4, 2c)."""
    return max(requests, c) if requests else max(4, 2 * c)


def bodies(model: str, n: int, max_tokens: int, seed: int, steps: int = 0) -> list[dict]:
    out = []
    for i, t in enumerate(_texts(n, seed)):
        b = {"model": model, "messages": [{"role": "user", "content": t}], "max_tokens": max_tokens,
             "stream": True, "stream_options": {"include_usage": True}, "seed": seed * 1000 + i}
        if steps:
            b["diffusion"] = {"max_denoising_steps": steps}
        out.append(b)
    return out


def _replica(url: str, name: str) -> dict:
    rows = httpx.get(url + "/admin/replicas", timeout=30).json()["replicas"]
    return next(r for r in rows if r["model"] == name and "engine" in r)


def _delta(after: dict, before: dict, key: str) -> float:
    return float(after.get(key, 0) or 0) - float(before.get(key, 0) or 0)


def _memory_stats(engine: dict) -> dict:
    """Whatever the engine reports about memory (budget, reserved bytes, sequences waiting for it)."""
    return {k: v for k, v in engine.items() if any(w in k for w in ("memory", "bytes", "budget", "reserved"))}


# -- tandem ---------------------------------------------------------------------------------
def tandem_config(args, name: str, model_path: str, sampler: str, boundaries: str, max_batch: int) -> dict:
    engine_args = {"family": "diffusiongemma", "max_batch": max_batch, "boundaries": boundaries, "num_threads": 1}
    if sampler != "exact":  # exact is the engine's default
        engine_args["sampler"] = sampler
    if args.memory_budget_gib:
        engine_args["memory_budget_gib"] = args.memory_budget_gib
    gpu = getattr(args, "device", "cpu") != "cpu"
    if gpu:
        engine_args["device"] = args.device
    return {"gateway": {"host": "127.0.0.1", "port": args.port}, "ray": {"num_cpus": 2},
            "models": [{"name": name, "kind": "diffusion", "source": model_path,
                        "resources": {"num_gpus": 1 if gpu else 0, "num_cpus": 1}, "engine_args": engine_args}]}


def run_tandem(args, name: str, model_path: str, workdir: Path, levels: list[int], sampler: str,
               boundaries: str, max_batch: int) -> dict:

    tag = f"{sampler}-{boundaries}"
    path = workdir / f"tandem-{tag}.yaml"
    path.write_text(yaml.safe_dump(tandem_config(args, name, model_path, sampler, boundaries, max_batch)))
    server = Server(f"tandem ({tag})", [sys.executable, "-m", "tandem_tools.cli", "--log-level", "warning",
                                        "serve", "--config", str(path)],
                    args.port, "/ready", workdir / f"tandem-{tag}.log", dict(os.environ))
    out = {}
    url = f"http://127.0.0.1:{args.port}"
    with server:
        server.wait_ready(args.ready_timeout)
        warm = bodies(name, 1, 1, 99, steps=1)  # one step of one block: loads and touches every path
        asyncio.run(run_level(url, warm, 1, timeout_s=args.level_timeout))
        for c in levels:
            n = num_requests(args.requests, c)
            rep = _replica(url, name)
            pid = rep["pid"]
            before, tree = rep["engine"], proc_tree(server.proc.pid)
            cpu0, rcpu0, rsys0 = {p: proc_cpu_s(p) for p in tree}, proc_cpu_s(pid), proc_cpu_s(pid, sys_only=True)
            rss0 = proc_mem(pid).get("VmRSS", 0)
            reset_peak(pid)
            t0 = time.perf_counter()
            with RssSampler(pid) as rss, EngineSampler(url, name) as engine:
                res = asyncio.run(run_level(url, bodies(name, n, args.max_tokens, c, args.steps), c,
                                            timeout_s=args.level_timeout))
            wall = time.perf_counter() - t0
            peak = proc_mem(pid).get("VmHWM", 0)
            tree = set(tree) | set(proc_tree(server.proc.pid))
            cpu, rcpu = tree_cpu_s(cpu0, tree), proc_cpu_s(pid) - rcpu0
            rsys = proc_cpu_s(pid, sys_only=True) - rsys0  # page faults (zeroing fresh memory) land here
            after = _replica(url, name)["engine"]
            steps = _delta(after, before, "steps")
            tokens = max(res.output_tokens, 1)
            out[c] = {
                "requests": res.requests, "errors": res.errors, "wall_s": wall, "output_tokens": res.output_tokens,
                "tokens_per_s": res.output_tokens_per_s, "latency_p50_ms": res.latency_p50_ms,
                "latency_p99_ms": res.latency_p99_ms, "first_block_p50_ms": res.ttft_p50_ms,
                "s_per_step": _delta(after, before, "busy_s") / steps if steps else float("nan"),
                "rows_per_step": _delta(after, before, "row_steps") / steps if steps else float("nan"),
                "outside_forward_share": max(0.0, 1 - _delta(after, before, "forward_s") / wall),
                "admission_wait_mean_ms": 1000 * _delta(after, before, "admission_wait_sum_s")
                / max(_delta(after, before, "admitted"), 1),
                "cpu_ms_per_token": 1000 * cpu / tokens, "replica_cpu_ms_per_token": 1000 * rcpu / tokens,
                # per row-step: does not depend on where a random model's EOS falls or on how the
                # arrivals happened to batch (a block's rows join at its boundary)
                "replica_cpu_ms_per_row_step": 1000 * rcpu / max(_delta(after, before, "row_steps"), 1),
                "sys_cpu_share": rsys / rcpu if rcpu else float("nan"),
                **memory_per_row(rss0, peak, rss.mean, min(c, max_batch)),
                **engine.summary(), "engine_memory": _memory_stats(after),
            }
            logger.info("tandem %s c=%d: %.2f tok/s, %.2f s/step, %.0f CPU ms/token, %d errors", tag, c,
                        res.output_tokens_per_s, out[c]["s_per_step"], out[c]["cpu_ms_per_token"], res.errors)
    return out


# -- HF generate(), in a child process --------------------------------------------------------
def run_hf(args, model_path: str, workdir: Path, levels: list[int]) -> tuple[dict, dict]:
    spec = {"model_path": model_path, "levels": levels, "max_tokens": args.max_tokens, "steps": args.steps,
            "requests": args.requests, "max_rss_gib": args.max_rss_gib, "device": getattr(args, "device", "cpu")}
    log = workdir / "hf.log"
    with log.open("w") as err:
        proc = subprocess.run([sys.executable, "-m", "tandem_tools.bench.diffusion", "--hf-child", json.dumps(spec)],
                              stdout=subprocess.PIPE, stderr=err, text=True, timeout=args.level_timeout * 4)
    if proc.returncode != 0:
        raise RuntimeError(f"HF generate() child failed ({proc.returncode}); see {log}: {log.read_text()[-2000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {int(k): v for k, v in result["sequential"].items()}, {int(k): v for k, v in result["static"].items()}


def _hf_child(spec: dict) -> dict:
    import torch
    from transformers import AutoTokenizer, DiffusionGemmaForBlockDiffusion

    torch.set_num_threads(1)
    path, max_tokens, steps = spec["model_path"], spec["max_tokens"], spec["steps"]
    device = torch.device(spec.get("device", "cpu"))
    cuda = device.type == "cuda"
    tok = AutoTokenizer.from_pretrained(path)
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=torch.float32).to(device).eval()
    eos_ids = model.generation_config.eos_token_id
    eos = set(eos_ids if isinstance(eos_ids, list) else [eos_ids])
    knobs = {"max_denoising_steps": steps} if steps else {}
    clock = {"decode_s": 0.0, "decodes": 0, "encode_s": 0.0}

    def timed(fn, key):  # generate() calls self.forward (decoder) and self.model.encoder (encoder)
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                clock[key + "_s"] += time.perf_counter() - t
                if key == "decode":
                    clock["decodes"] += 1
        return wrapper

    model.forward = timed(model.forward, "decode")
    model.model.encoder.forward = timed(model.model.encoder.forward, "encode")

    def count(row: list[int]) -> int:
        cut = next((i for i, t in enumerate(row) if t in eos), None)
        return min(cut if cut is not None else len(row), max_tokens)

    def ids(text: str) -> list[int]:
        return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False)

    def measure(batches: list[list[list[int]]], rows: int) -> tuple[dict, list[float]]:
        for k in clock:
            clock[k] = 0
        rss0 = proc_mem().get("VmRSS", 0)
        reset_peak()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            dev0 = torch.cuda.memory_allocated()
        cpu0, sys0, service, tokens = time.process_time(), os.times().system, [], 0
        with RssSampler("self") as rss:
            for batch in batches:
                t0 = time.perf_counter()
                out = model.generate(torch.tensor(batch, device=device), max_new_tokens=max_tokens, **knobs)
                service.append(time.perf_counter() - t0)  # .tolist() below waits for the device
                tokens += sum(count(r) for r in out.sequences[:, len(batch[0]):].tolist())
        wall, cpu = sum(service), time.process_time() - cpu0
        sys_cpu = os.times().system - sys0
        forwards = clock["decode_s"] + clock["encode_s"]  # on a GPU: launch time, not kernel time
        res = {"tokens_per_s": tokens / wall, "output_tokens": tokens, "wall_s": wall,
               "s_per_step": wall / max(clock["decodes"], 1), "rows_per_step": rows,
               "outside_forward_share": max(0.0, 1 - forwards / wall),
               "cpu_ms_per_token": 1000 * cpu / max(tokens, 1), "sys_cpu_share": sys_cpu / cpu if cpu else float("nan"),
               **memory_per_row(rss0, proc_mem().get("VmHWM", 0), rss.mean, rows)}
        if cuda:
            res["device_peak_growth_per_row_mb"] = (torch.cuda.max_memory_allocated() - dev0) / rows / MB
        return res, service

    model.generate(torch.tensor([ids("warm up")], device=device), max_new_tokens=1, max_denoising_steps=1)
    seq, static, peak_row = {}, {}, 0.0
    for c in spec["levels"]:
        prompts = [ids(t) for t in _texts(num_requests(spec["requests"], c), c)]
        seq[c], service = measure([[p] for p in prompts], 1)
        lat = fifo_latencies(service, c)
        seq[c].update(latency_p50_ms=percentile(lat, 0.5) * 1000, latency_p99_ms=percentile(lat, 0.99) * 1000)
        peak_row = max(peak_row, seq[c]["peak_growth_per_row_mb"])
        log(f"HF sequential c={c}: {seq[c]['tokens_per_s']:.2f} tok/s")
        if c == 1:
            continue  # a static batch of one is the sequential run
        need_gib = (seq[c]["rss_before_mb"] + c * peak_row) / 1024
        if need_gib > spec["max_rss_gib"]:
            static[c] = {"skipped": f"needs ~{need_gib:.1f} GiB > --max-rss-gib {spec['max_rss_gib']}"}
            log(f"HF static c={c}: {static[c]['skipped']}")
            continue
        # Static batches of c equal-length prompts (the median length, truncated or repeated).
        length = sorted(len(p) for p in prompts)[len(prompts) // 2]
        equal = [(p * (length // len(p) + 1))[:length] for p in prompts]
        static[c], service = measure([equal[i:i + c] for i in range(0, len(equal), c)], c)
        done = [sum(service[:i + 1]) for i in range(len(service)) for _ in range(c)]
        static[c].update(latency_p50_ms=percentile(done, 0.5) * 1000, latency_p99_ms=percentile(done, 0.99) * 1000)
        log(f"HF static c={c}: {static[c]['tokens_per_s']:.2f} tok/s")
    return {"sequential": seq, "static": static}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fifo_latencies(service: list[float], clients: int) -> list[float]:
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



# -- the report -----------------------------------------------------------------------------
COLUMNS = [
    ("out tok/s", "tokens_per_s", "{:.2f}"),
    ("s/step", "s_per_step", "{:.2f}"),
    ("rows/step", "rows_per_step", "{:.1f}"),
    ("outside forwards", "outside_forward_share", "{:.1%}"),
    ("CPU ms/token (all processes)", "cpu_ms_per_token", "{:.0f}"),
    ("CPU ms/token (replica)", "replica_cpu_ms_per_token", "{:.0f}"),
    ("CPU ms/row-step (replica)", "replica_cpu_ms_per_row_step", "{:.0f}"),
    ("of it in the kernel (page faults)", "sys_cpu_share", "{:.0%}"),
    ("peak RSS growth/row MB", "peak_growth_per_row_mb", "{:.0f}"),
    ("mean RSS growth/row MB", "mean_growth_per_row_mb", "{:.0f}"),
    ("device peak growth/row MB", "device_peak_growth_per_row_mb", "{:.0f}"),
    ("engine reservation/row MB", "reserved_per_row_mb", "{:.0f}"),
    ("waiting for memory (max)", "waiting_for_memory_max", "{:d}"),
    ("latency p50 ms", "latency_p50_ms", "{:.0f}"),
    ("1st block p50 ms", "first_block_p50_ms", "{:.0f}"),
    ("admission wait mean ms", "admission_wait_mean_ms", "{:.0f}"),
    ("errors", "errors", "{:d}"),
]
BASELINE = "hf sequential"


def format_table(results: dict[str, dict[int, dict]], levels: list[int]) -> str:
    """One row per (level, metric), one column per target, then each target's tok/s and CPU per
    token as ratios to HF sequential's (a higher tok/s ratio is better, a lower CPU ratio)."""
    names = list(results)
    lines = ["| conc | metric | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for c in levels:
        cells = {n: results[n].get(c, {}) for n in names}
        for label, key, fmt in COLUMNS:
            vals = [cells[n].get(key) for n in names]
            if all(v is None for v in vals):
                continue
            lines.append(f"| {c} | {label} | " + " | ".join("-" if v is None else fmt.format(v) for v in vals) + " |")
        skipped = [f"{n}: {cells[n]['skipped']}" for n in names if "skipped" in cells[n]]
        if skipped:
            lines.append(f"| {c} | skipped | " + "; ".join(skipped) + " |" + " |" * (len(names) - 1))
        base = cells.get(BASELINE, {})
        for label, key in (("tok/s / HF sequential", "tokens_per_s"),
                           ("CPU per token / HF sequential", "cpu_ms_per_token")):
            if not base.get(key):
                continue
            vals = [cells[n].get(key) for n in names]
            lines.append(f"| {c} | {label} | " + " | ".join(
                "-" if not v else f"{v / base[key]:.2f}x" for v in vals) + " |")
    return "\n".join(lines)


def _model(args) -> tuple[str, str, list[str]]:
    """(served name, path, samplers): a '-fast' suffix picks the fast sampler only."""
    from workers import tiny_models

    name, samplers = args.model, [s.strip() for s in args.samplers.split(",") if s.strip()]
    if name.endswith("-fast"):
        name, samplers = name[: -len("-fast")], ["fast"]
    path = str(tiny_models.build(name)) if name in tiny_models.BUILDERS else name
    return Path(name).name, path, samplers


def code_version() -> str:
    """The commit the benchmark runs (servers import the working tree when they start: a tree
    edited during a run mixes versions, hence "dirty")."""
    root = Path(__file__).resolve().parents[2]
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], cwd=root, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        marker = root / ".commit"  # a `git archive` snapshot may carry one
        return marker.read_text().strip() if marker.exists() else "unknown"


def levels_for(args, max_batch: int = 0) -> list[int]:
    if args.concurrency != "1,8,32":  # the AR default: not given
        return [int(x) for x in args.concurrency.split(",")]
    if args.model.startswith(SHAPE):
        return sorted({1, 4, max_batch or 4})
    return [1, 4, 8, 16]


def op_counts(model_path: str, rows: str = "1,4", device_form: bool = False) -> list[dict]:
    """``tandem_tools.bench.opcount`` on the benchmark's model, in its own process (one model in memory
    at a time), eager or in the step's device form; [] if it fails (logged)."""
    proc = subprocess.run([sys.executable, "-m", "tandem_tools.bench.opcount",
                           "--model", str(Path(model_path).resolve()), "--rows", rows, "--json",
                           *(["--device-form"] if device_form else [])],
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        logger.error("opcount failed: %s", proc.stderr[-1500:])
        return []
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def main(args) -> int:
    import tempfile

    logging.getLogger("httpx").setLevel(logging.WARNING)
    args.level_timeout = getattr(args, "level_timeout", None) or 3600
    name, model_path, samplers = _model(args)
    levels = levels_for(args, args.max_batch)
    max_batch = args.max_batch or max(levels)
    boundaries = [b.strip() for b in args.boundaries.split(",") if b.strip()]
    targets = [(s, b) for s in samplers for b in boundaries]
    results: dict[str, dict] = {}
    t_start, version = time.time(), code_version()
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
        work = Path(tmp)
        # HF first, in its own process: nothing of a server (Ray, its actor) runs beside it.
        groups = [[c] for c in levels] if args.interleave else [levels]
        for group in groups:
            if not args.no_hf:
                seq, static = run_hf(args, model_path, work, group)
                results.setdefault(BASELINE, {}).update(seq)
                results.setdefault("hf static batch", {}).update(static)
            for s, b in targets:
                try:
                    res = run_tandem(args, name, model_path, work, group, s, b, max_batch)
                except (RuntimeError, httpx.HTTPError, TimeoutError, StopIteration) as e:
                    # One target failing (an engine argument it does not take, a level past its
                    # time) must not cost the rest of a long run.
                    log_path = work / f"tandem-{s}-{b}.log"
                    tail = log_path.read_text()[-1500:] if log_path.exists() else ""
                    logger.error("tandem %s %s failed: %s\n%s", s, b, e, tail)
                    res = {c: {"skipped": f"failed: {type(e).__name__}: {str(e)[:160]}"} for c in group}
                results.setdefault(f"tandem {s} {b}", {}).update(res)
    steps = f"{args.steps} denoise steps" if args.steps else "the model's default diffusion settings"
    print(f"\nstreaming chat, {name}, {args.max_tokens} output tokens/request, {steps}, max_batch {max_batch}, "
          f"one torch thread per engine; code {version}; {time.time() - t_start:.0f} s\n")
    print(format_table(results, levels))
    forms = ("eager", "device") if "fast" in samplers and not args.no_counts else ()
    ops = [{**r, "form": form} for form in forms for r in op_counts(model_path, device_form=form == "device")]
    for r in ops:
        how = ("eager" if r["form"] == "eager" else "device form: compiled parts' launches from inductor's code")
        print(f"aten ops per fast denoise step ({how}; counted on the host, python -m tandem_tools.bench.opcount"
              f"{' --device-form' if r['form'] == 'device' else ''}): {r['rows']} row(s): {r['ops']:,}, "
              f"{r['per_layer']:,} per layer; host syncs {r['syncs'] or 'none'}")
    if args.out:
        Path(args.out).write_text(json.dumps({"model": name, "levels": levels, "max_tokens": args.max_tokens,
                                              "steps": args.steps, "max_batch": max_batch, "code": version,
                                              "results": results, "aten_ops_per_step": ops},
                                             indent=1, default=str))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--hf-child":
        print(json.dumps(_hf_child(json.loads(sys.argv[2]))))
        sys.exit(0)
    sys.exit("usage: python -m tandem_tools.bench.diffusion --hf-child SPEC (use `tandem bench --mode diffusion`)")
