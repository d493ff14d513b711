"""`tandem serve` takes its port before anything else: a port in use is one line and exit 2, before
Ray starts (whose own processes could otherwise take a free port between its choice and the bind)."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize("processes", ["1", "2"])
def test_a_port_in_use_fails_at_once_in_one_line(processes):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([str(Path(sys.executable).parent / "tandem"), "serve", "--port", str(port),
                               "--processes", processes], capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    assert f"cannot listen on 127.0.0.1:{port}" in out
    assert "Ray" not in out and "Traceback" not in out  # nothing started, nothing crashed
