"""The two-worker run's plumbing (``tests/parallel.py``): a module marked ``alone`` excludes every
other module's turn and is let in before the next shared taker; shared turns overlap."""

from __future__ import annotations

import os
import threading

from tests import parallel
from tests.waiting import wait_for


def _turn(lock_dir, alone: bool, entered: threading.Event, leave: threading.Event) -> threading.Thread:
    def run() -> None:
        with parallel.module_turn(lock_dir, alone):
            entered.set()
            leave.wait(30)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_shared_turns_overlap_and_an_alone_turn_waits_for_them_then_goes_first(tmp_path):
    a_in, a_out, b_in, b_out = (threading.Event() for _ in range(4))
    threads = [_turn(tmp_path, False, a_in, a_out), _turn(tmp_path, False, b_in, b_out)]
    wait_for(lambda: a_in.is_set() and b_in.is_set(), "two shared turns at once", timeout=10)
    alone_in, alone_out = threading.Event(), threading.Event()
    threads.append(_turn(tmp_path, True, alone_in, alone_out))
    a_out.set()  # one shared turn ends; the other still holds: the alone turn waits
    threads[0].join(10)
    assert not alone_in.wait(0.5)
    late_in, late_out = threading.Event(), threading.Event()
    threads.append(_turn(tmp_path, False, late_in, late_out))  # a shared taker arriving behind the alone one
    b_out.set()
    wait_for(alone_in.is_set, "the alone turn once the shared ones ended", timeout=10)
    assert not late_in.wait(0.5), "a shared turn overlapped the alone one"
    alone_out.set()
    wait_for(late_in.is_set, "the next shared turn after the alone one", timeout=10)
    late_out.set()
    for t in threads:
        t.join(10)


def test_each_worker_binds_its_engines_to_a_core_of_its_own_and_one_process_binds_nothing(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    parallel.bind_engines_to_a_core()
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ  # one process: vLLM's own choice
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    cores = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
        parallel.bind_engines_to_a_core()
        cores.append(os.environ["VLLM_CPU_OMP_THREADS_BIND"])
    assert cores == ["0", "1"]
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # a user's own choice is kept
    parallel.bind_engines_to_a_core()
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
