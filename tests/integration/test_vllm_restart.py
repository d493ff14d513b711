"""The real thing: vLLM's replica process killed (SIGKILL) under a stream. The stream ends with an
error event and [DONE], requests meanwhile get a clear error, Ray restarts the actor, the gateway
starts vLLM in the new process, and the model answers exactly as before; vLLM's EngineCore of the
dead process does not linger. (The shared stack is healthy again when this module ends.)"""

import json
import os
import signal
import threading
import time

import httpx
import pytest

# alone under -n (tests/parallel.py): a hung engine found by the health check's timeout
pytestmark = pytest.mark.alone

MODEL = "tiny-llama"
ASK = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the river."}], "max_tokens": 12,
       "temperature": 0}


def _replica(stack) -> dict:
    return stack.replica_stats(MODEL)[0]


def _restarted(stack, restarts: int, timeout: float, what: str) -> dict:
    """Waits until the replica is healthy after more than ``restarts`` restarts; returns it."""
    deadline = time.monotonic() + timeout
    while True:
        replica = _replica(stack)
        if replica["state"] == "healthy" and replica["restarts"] > restarts:
            return replica
        assert time.monotonic() < deadline, f"{what}: {replica}\n{stack.log_tail()}"
        time.sleep(1)  # a poll interval of the wait above (deadline, loud failure)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_killed_vllm_replica_errors_its_requests_and_comes_back(stack):
    before = httpx.post(stack.url + "/v1/chat/completions", json=ASK, timeout=60).json()["choices"][0]["message"]
    replica = _replica(stack)
    pid, restarts = replica["pid"], replica["restarts"]
    engine_procs = _children(pid)
    events: list[str] = []
    started = threading.Event()

    def stream():
        body = {**ASK, "max_tokens": 400, "stream": True, "temperature": 1.0}
        with httpx.stream("POST", stack.url + "/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    os.kill(pid, signal.SIGKILL)
    t.join(60)
    assert not t.is_alive() and events[-1] == "[DONE]" and "error" in json.loads(events[-2]), events[-3:]
    # while it restarts: a clear error at once (one replica: nowhere to retry), never a hang
    r = httpx.post(stack.url + "/v1/chat/completions", json=ASK, timeout=60)
    assert r.status_code in (500, 503) and set(r.json()["error"]) == {"message", "type", "param", "code"}
    replica = _restarted(stack, restarts, 300, "the vLLM replica did not come back")
    assert replica["pid"] != pid
    after = httpx.post(stack.url + "/v1/chat/completions", json=ASK, timeout=60).json()["choices"][0]["message"]
    assert after["content"] == before["content"]  # the same engine again: the same greedy answer
    deadline = time.monotonic() + 60
    while any(_alive(p) for p in engine_procs) and time.monotonic() < deadline:
        time.sleep(0.5)  # a poll interval of the wait above (deadline, loud failure)
    assert not any(_alive(p) for p in engine_procs), "the dead replica's vLLM processes linger"
    assert httpx.get(stack.url + "/ready", timeout=10).status_code == 200


def _engine_core(pid: int) -> int | None:
    """vLLM's EngineCore process among the replica process's descendants (any thread's children)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue

    def under(p: int) -> bool:
        while p > 1:
            p = parents.get(p, 0)
            if p == pid:
                return True
        return False

    for p in parents:
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                if b"EngineCore" in f.read() and under(p):
                    return p
        except OSError:
            continue
    return None


def test_an_idle_engine_core_that_hangs_is_taken_out_of_rotation_then_restarted(stack):
    """SIGSTOP on vLLM's EngineCore while no request runs: the health check's round trip to it
    times out, so the replica leaves rotation within a few health intervals (before any request is
    sent to it), and it is restarted after stall_timeout_s; then it serves as before."""
    cfg = stack.config["gateway"]
    interval = cfg.get("health_interval_s", 5)
    before = httpx.post(stack.url + "/v1/chat/completions", json=ASK, timeout=60).json()["choices"][0]["message"]
    replica = _replica(stack)
    restarts, core = replica["restarts"], _engine_core(replica["pid"])
    assert core is not None, "no EngineCore process under the vLLM replica"
    os.kill(core, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        deadline = t0 + 10 * interval + 30
        while _replica(stack)["state"] != "unhealthy":
            assert time.monotonic() < deadline, f"a hung engine core stayed in rotation: {_replica(stack)}"
            time.sleep(0.2)  # a poll interval of the wait above (deadline, loud failure)
        out_after = time.monotonic() - t0
        _restarted(stack, restarts, 400, "the hung replica was not restarted")
    finally:
        try:
            os.kill(core, signal.SIGKILL)  # the stopped core outlives its killed parent otherwise
        except ProcessLookupError:
            pass
    print(f"out of rotation {out_after:.1f} s after the engine core stopped (health interval {interval} s)")
    after = httpx.post(stack.url + "/v1/chat/completions", json=ASK, timeout=60).json()["choices"][0]["message"]
    assert after["content"] == before["content"]
