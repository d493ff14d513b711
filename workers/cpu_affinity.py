"""Keep tandem's own processes off the cores vLLM's CPU worker is pinned to.

vLLM's CPU backend binds its model worker's OpenMP threads to fixed cores (core 0 on a
2-core box). Anything else scheduled there preempts the forward pass. Measured here (2 cores,
32 streams): moving the gateway and the replica actor off that core took tandem from 2578 to
4032 output tokens/s, and at 1 stream from 260 to 472. On GPU nodes there is no such worker
and this does nothing.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)
WORKER_PREFIX = "VLLM::Worker"


def vllm_worker_cores() -> set[int]:
    """Cores that vLLM CPU workers on this node are pinned to (empty if none are pinned)."""
    import psutil

    everything = set(os.sched_getaffinity(0)) | set(range(os.cpu_count() or 1))
    cores: set[int] = set()
    for proc in psutil.process_iter(["name", "cmdline"]):
        try:
            name = proc.info["name"] or ""
            cmdline = " ".join(proc.info["cmdline"] or [])
            if not name.startswith(WORKER_PREFIX) and not cmdline.startswith(WORKER_PREFIX):
                continue
            affinity = set(proc.cpu_affinity())
        except (psutil.Error, OSError):
            continue
        if affinity and affinity < everything:
            cores |= affinity
    return cores


def keep_off(cores: set[int]) -> set[int] | None:
    """Move every thread of this process off ``cores``; returns the cores kept (None: unchanged)."""
    if not cores:
        return None
    allowed = set(os.sched_getaffinity(0)) - cores
    if not allowed:
        return None
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), allowed)
        except OSError:
            pass  # a thread that just ended
    logger.info("pid %d keeps off vLLM worker cores %s (runs on %s)", os.getpid(), sorted(cores), sorted(allowed))
    return allowed


def keep_off_vllm_workers() -> set[int] | None:
    return keep_off(vllm_worker_cores())
