"""The servers a benchmark starts, one at a time, and the prompts it sends them.

Servers start in a new process group of this session (a new *session* was seen to deliver
streams in bursts, ~10x worse TTFT).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import httpx

logger = logging.getLogger("tandem.bench")
CORPUS = Path(__file__).resolve().parents[2] / "workers" / "data" / "corpus.txt"


def prompts(n: int, seed: int = 0) -> list[str]:
    lines = [ln for ln in CORPUS.read_text().splitlines() if ln.strip()]
    rng = random.Random(seed)
    return [" ".join(rng.sample(lines, rng.randint(1, 3))) for _ in range(n)]


class Server:
    def __init__(self, name: str, argv: list[str], port: int, ready_path: str, log: Path, env: dict):
        self.name, self.argv, self.port, self.ready_path, self.log = name, argv, port, ready_path, log
        self.env = env
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        logger.info("starting %s: %s (log: %s)", self.name, " ".join(self.argv), self.log)
        self.proc = subprocess.Popen(self.argv, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     env=self.env, process_group=0)
        return self

    def wait_ready(self, timeout: float) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); see {self.log}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}{self.ready_path}", timeout=2).status_code == 200:
                    logger.info("%s ready in %.0f s", self.name, time.monotonic() - t0)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s; see {self.log}")

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, TypeError):
            pass
        time.sleep(2)  # let the cores go quiet before the next server
