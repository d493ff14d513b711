"""SIGTERM: /ready turns false, new requests are refused, in-flight ones finish, exit 0."""

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.unit.gateway_server import free_port
from tests.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]


def test_sigterm_drains_then_exits_0(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    control = tmp_path / "control.json"
    control.write_text("{}")
    proc = subprocess.Popen([sys.executable, "-m", "tests.unit.fake_serve", str(port), "0.05", str(control)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(url + "/ready", timeout=10).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "fake server did not start"
            time.sleep(0.1)  # a poll interval of the wait above (deadline, loud failure)
        lines = []
        # Held from the start (the engine emits nothing while the control file says so): the
        # stream is in flight, whatever the box's speed, until the test lets it go.
        control.write_text(json.dumps({str(proc.pid): "stall"}))

        def stream():
            body = {"model": "fake", "messages": [{"role": "user", "content": "x"}], "stream": True}
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
                lines.extend(line for line in r.iter_lines() if line)

        def engine_running() -> int:
            return httpx.get(url + "/admin/replicas", timeout=60).json()["replicas"][0]["engine"]["running"]

        t = threading.Thread(target=stream)
        t.start()
        wait_for(lambda: engine_running() == 1, "the stream to reach the engine")
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(url + "/ready", timeout=60).status_code == 503, "readiness to turn false on SIGTERM")
        refused = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "x"}, timeout=60)
        assert refused.status_code == 503 and refused.headers.get("Retry-After")
        control.write_text("{}")  # the held stream goes on and finishes within the drain
        t.join(60)
        assert lines[-1] == "data: [DONE]" and sum(1 for ln in lines if "tok" in ln) == 20  # the whole answer
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
