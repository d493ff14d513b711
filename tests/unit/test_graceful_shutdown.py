"""SIGTERM: /ready turns false, new requests are refused, in-flight ones finish, exit 0."""

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.unit.gateway_server import free_port

REPO = Path(__file__).resolve().parents[2]


def test_sigterm_drains_then_exits_0():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "tests.unit.fake_serve", str(port), "0.1"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "fake server did not start"
            time.sleep(0.1)
        lines, started = [], threading.Event()

        def stream():
            body = {"model": "fake", "messages": [{"role": "user", "content": "x"}], "stream": True}
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                    started.set()

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(10)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        ready = httpx.get(url + "/ready", timeout=5)
        assert ready.status_code == 503
        refused = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "x"}, timeout=5)
        assert refused.status_code == 503 and refused.headers.get("Retry-After")
        t.join(20)
        assert lines[-1] == "data: [DONE]" and sum(1 for ln in lines if "tok" in ln) == 20  # the whole answer
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
