"""`tandem serve MODEL` against `vllm serve MODEL` with the same flags (issue 32): seconds until
each serves (tandem: /ready; vLLM: /v1/models), the CPU seconds its process tree spent getting
there, and whether a greedy answer is the same. One server alive at a time, in interleaved
rounds; the diffusion model (no peer server) is timed alone.

    python -m tandem_tools.bench.startup --rounds 2
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

from tandem_tools.bench import procstat
from tandem_tools.bench.servers import Server

REPO = Path(__file__).resolve().parents[2]
FLAGS = ["--max-model-len", "512", "--dtype", "float32", "--enforce-eager"]
logger = logging.getLogger("tandem.bench")


def _argv(name: str, model: str, port: int) -> tuple[list[str], str]:
    if name == "vllm":
        return [sys.executable, str(REPO / "tandem_tools" / "vllm_cli_shim.py"), "serve", model, *FLAGS,
                "--port", str(port)], "/v1/models"
    tandem = str(Path(sys.executable).parent / "tandem")
    if name == "tandem-diffusion":
        return [tandem, "serve", model, "--port", str(port)], "/ready"
    return [tandem, "serve", model, *FLAGS, "--port", str(port)], "/ready"


def _cpu_with_reaped(pid: int) -> float:
    """A process's CPU seconds plus those of its children that ended and were waited for."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return 0.0
    return sum(int(f) for f in fields[11:15]) / procstat.CLK_TCK  # utime, stime, cutime, cstime


def one(name: str, model: str, port: int, workdir: Path) -> dict:
    argv, ready = _argv(name, model, port)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4"}  # what tandem serve MODEL sets on a CPU host
    with Server(name, argv, port, ready, workdir / f"{name}.log", env) as s:
        t0 = time.monotonic()
        s.wait_ready(600)
        seconds = time.monotonic() - t0
        cpu = sum(_cpu_with_reaped(p) for p in procstat.tree(s.proc.pid))
        served = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()["data"][0]["id"]
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120, json={
            "model": served, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 16,
            "temperature": 0})
        text = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else f"error {r.status_code}"
    return {"seconds": seconds, "cpu_s": cpu, "text": text}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    ap.add_argument("--port", type=int, default=8141)
    ap.add_argument("--workdir", default="/tmp/tandem-bench-startup")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    llama, diffusion = str(REPO / "models" / "tiny-llama"), str(REPO / "models" / "tiny-diffusiongemma")
    runs: dict[str, list[dict]] = {"vllm": [], "tandem": [], "tandem-diffusion": []}
    for i in range(args.rounds):
        order = ["vllm", "tandem"] if i % 2 == 0 else ["tandem", "vllm"]
        for name in [*order, "tandem-diffusion"]:
            runs[name].append(one(name, diffusion if name == "tandem-diffusion" else llama, args.port, workdir))
            logger.info("%s round %d: %s", name, i + 1, runs[name][-1])
    print(f"\n{'server':18} {'ready s (median)':>17} {'tree CPU s':>11}  rounds")
    for name, rows in runs.items():
        print(f"{name:18} {statistics.median(r['seconds'] for r in rows):17.1f} "
              f"{statistics.median(r['cpu_s'] for r in rows):11.1f}  {len(rows)}")
    ratio = statistics.median(r["seconds"] for r in runs["tandem"]) / statistics.median(
        r["seconds"] for r in runs["vllm"])
    cpu = statistics.median(r["cpu_s"] for r in runs["tandem"]) / statistics.median(r["cpu_s"] for r in runs["vllm"])
    same = {r["text"] for r in runs["tandem"]} == {r["text"] for r in runs["vllm"]}
    print(f"tandem / vllm: ready {ratio:.2f}x, tree CPU {cpu:.2f}x; greedy answers equal: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
