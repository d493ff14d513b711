"""How the suite runs on two workers (`make test`: pytest-xdist, ``-n 2 --dist loadgroup``).

- **One work unit per module**, so a module's own stack (a module-scoped fixture) starts once;
  and **one unit for every module on the session's shared stack** (the ``stack`` fixture), so a
  run starts that stack once. xdist sends the largest units first.
- **Alone**: a module marked ``pytest.mark.alone`` (it stops or stalls processes on purpose and
  waits on leases, drains or health checks measured in seconds, or it loads both cores for
  minutes) runs while the other worker runs nothing: it takes ``alone.lock`` exclusively, every
  other module takes it shared. A turnstile lets a waiting exclusive taker in before the next
  shared one (no starvation).

- **A core each**: vLLM's CPU worker pins its process to one core (``VLLM_CPU_OMP_THREADS_BIND``
  ``auto`` reserves the last core and binds to core 0: every engine of a run on core 0). Each
  worker's engines (its stacks inherit its environment) get a core of their own: ``gw0`` core 0,
  ``gw1`` core 1 (``bind_engines_to_a_core``).

Without ``-n`` (one process) nothing of this applies: the locks are not taken, vLLM binds as it
does for a user.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from _pytest.nodeid import coerce_node_id

SHARED_STACK = "the-shared-stack"


def group_items(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Name each test's work unit in its node id, as xdist's ``--dist loadgroup`` reads it
    (``<id>@<unit>``): its module, or the shared stack's. Only in an xdist worker. (xdist's own
    ``xdist_group`` mark sets ``item._nodeid``, which pytest 9 no longer reads: its node id is
    ``item._id``.)"""
    if not getattr(config.option, "loadgroup", False):
        return
    on_stack = {item.module.__name__ for item in items if "stack" in getattr(item, "fixturenames", ())}
    for item in items:
        name = item.module.__name__
        item._id = coerce_node_id(f"{item.nodeid}@{SHARED_STACK if name in on_stack else name}")


@contextmanager
def module_turn(lock_dir: Path, alone: bool) -> Iterator[None]:
    """Hold the run's lock for one module: exclusively (``alone``) or shared."""
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / "turnstile.lock", "a+") as gate, open(lock_dir / "alone.lock", "a+") as main:
        if alone:
            fcntl.flock(gate, fcntl.LOCK_EX)  # shared takers queue behind this one from now on
            fcntl.flock(main, fcntl.LOCK_EX)
        else:
            fcntl.flock(gate, fcntl.LOCK_SH)
            fcntl.flock(gate, fcntl.LOCK_UN)
            fcntl.flock(main, fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(main, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(gate, fcntl.LOCK_UN)


class Turns:
    """This worker's current module turn (``module_turn``), taken at a module's first test and
    given back after its last one: outside any test's timeout, so a wait for the other worker's
    module never counts as a test's time."""

    def __init__(self):
        self.module, self.held = None, None

    def enter(self, item: pytest.Item, lock_dir: Path) -> None:
        if self.module is item.module:
            return
        self.leave()
        self.held = module_turn(lock_dir, item.get_closest_marker("alone") is not None)
        self.held.__enter__()
        self.module = item.module

    def leave(self) -> None:
        if self.held is not None:
            held, self.held, self.module = self.held, None, None
            held.__exit__(None, None, None)


TURNS = Turns()


def running_in_parallel() -> bool:
    return "PYTEST_XDIST_WORKER" in os.environ


def bind_engines_to_a_core() -> None:
    """Under ``-n``: this worker's vLLM engines (in every process it starts) on a core of their own."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit() and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(int(worker[2:]) % (os.cpu_count() or 1))
