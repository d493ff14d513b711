"""Drive load with `vllm bench serve` (the benchmark vLLM ships), one concurrency level per run.

Each level is one `vllm bench serve` process (through ``tandem_tools.vllm_cli_shim``): the random
dataset at fixed input and output lengths, ``--ignore-eos``, streaming chat, a closed loop of
``--max-concurrency`` clients, warm-up requests first, the result saved as JSON. While it runs,
the CPU time of chosen server processes is read from /proc when it prints "Starting main
benchmark run" and again when it prints its result banner, so the figure covers the measured
requests only (not its own start-up, its warm-up, or an idle engine's busy-wait).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

logger = logging.getLogger("tandem.bench")
START_MARK = "Starting main benchmark run"
END_MARK = "Serving Benchmark Result"


@dataclass
class LevelSpec:
    base_url: str
    model: str  # served model name
    tokenizer: str  # path of the model's tokenizer (the random dataset samples its vocabulary)
    concurrency: int
    num_prompts: int
    input_len: int
    output_len: int
    seed: int = 0
    warmups: int = 0  # default: one per client


def bench_serve_argv(spec: LevelSpec, result_dir: Path, result_file: str) -> list[str]:
    """The `vllm bench serve` command line of one level."""
    return [
        sys.executable, "-m", "tandem_tools.vllm_cli_shim", "bench", "serve",
        "--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url", spec.base_url,
        "--model", spec.model, "--tokenizer", spec.tokenizer,
        "--dataset-name", "random", "--random-input-len", str(spec.input_len),
        "--random-output-len", str(spec.output_len), "--random-range-ratio", "0", "--ignore-eos",
        "--temperature", "0", "--seed", str(spec.seed),
        "--max-concurrency", str(spec.concurrency), "--num-prompts", str(spec.num_prompts),
        "--num-warmups", str(spec.warmups or spec.concurrency),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(result_dir), "--result-filename", result_file, "--disable-tqdm",
    ]


@dataclass
class LevelResult:
    """One level of one target in one round: `vllm bench serve`'s figures plus CPU seconds of
    the server processes asked for (name -> seconds over the measured requests)."""

    concurrency: int
    completed: int
    failed: int
    duration_s: float
    output_tokens: int
    output_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    tpot_p50_ms: float
    cpu_s: dict[str, float] = field(default_factory=dict)
    cpu_window: str = "measured requests"  # or "whole bench process" when the markers were not seen

    def cpu_ms_per_request(self, name: str) -> float | None:
        s = self.cpu_s.get(name)
        return None if s is None or not self.completed else 1000.0 * s / self.completed

    def cpu_ms_per_1k_tokens(self, name: str) -> float | None:
        s = self.cpu_s.get(name)
        return None if s is None or not self.output_tokens else 1000.0 * s / (self.output_tokens / 1000.0)

    def as_dict(self) -> dict:
        return asdict(self)


def parse_result(data: dict, cpu: dict[str, float] | None = None, cpu_window: str = "measured requests") -> LevelResult:
    """A `vllm bench serve --save-result` JSON (with ``--metric-percentiles 50,99``)."""
    nan = float("nan")
    return LevelResult(
        concurrency=int(data.get("max_concurrency") or 0),
        completed=int(data.get("completed", 0)),
        failed=int(data.get("failed", 0)),
        duration_s=float(data.get("duration", nan)),
        output_tokens=int(data.get("total_output_tokens", 0)),
        output_tok_s=float(data.get("output_throughput", nan)),
        ttft_p50_ms=float(data.get("p50_ttft_ms", data.get("median_ttft_ms", nan))),
        ttft_p99_ms=float(data.get("p99_ttft_ms", nan)),
        itl_p50_ms=float(data.get("p50_itl_ms", data.get("median_itl_ms", nan))),
        tpot_p50_ms=float(data.get("p50_tpot_ms", data.get("median_tpot_ms", nan))),
        cpu_s=dict(cpu or {}),
        cpu_window=cpu_window,
    )


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: max(0.0, after[k] - before[k]) for k in before if k in after}


def run_level(spec: LevelSpec, workdir: Path, sample_cpu: Callable[[], dict[str, float]], tag: str,
              timeout_s: float = 900, affinity: set[int] | None = None) -> LevelResult:
    """Run one level; ``sample_cpu`` returns {process name: CPU seconds so far}."""
    result_file = f"{tag}.json"
    log_path = workdir / f"{tag}.bench.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    preexec = (lambda: os.sched_setaffinity(0, affinity)) if affinity else None
    before = after = None
    argv = ["timeout", "-k", "10", str(int(timeout_s)), *bench_serve_argv(spec, workdir, result_file)]
    with log_path.open("w") as log, subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                                     text=True, preexec_fn=preexec) as proc:
        outer = sample_cpu()
        try:
            for line in proc.stdout:
                log.write(line)
                if before is None and START_MARK in line:
                    before = sample_cpu()
                elif before is not None and after is None and END_MARK in line:
                    after = sample_cpu()
            proc.wait()
        except BaseException:
            proc.kill()
            raise
    if proc.returncode != 0 or not (workdir / result_file).exists():
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}); see {log_path}")
    if before is None or after is None:
        before, after, window = outer, sample_cpu(), "whole bench process"
    else:
        window = "measured requests"
    data = json.loads((workdir / result_file).read_text())
    return parse_result(data, cpu_delta(before, after), window)
