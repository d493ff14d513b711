"""`tandem serve`'s server loop around fake engines (for the graceful-shutdown test)."""

import sys

from gateway.config import parse_config
from gateway.http.app import build_app
from gateway.http.server import run_server
from gateway.observability.logs import setup_logging
from gateway.serving.service import Service
from workers.fake_engine import FakeDeployment

if __name__ == "__main__":
    port, delay, control = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None
    setup_logging("info")
    config = parse_config({"gateway": {"port": port, "drain_timeout_s": 60},
                           "models": [{"name": "fake", "kind": "autoregressive", "source": "none"}]})
    service = Service(config, FakeDeployment({"num_tokens": 20, "token_delay_s": delay, "control_file": control}))
    run_server(build_app(service), service)
