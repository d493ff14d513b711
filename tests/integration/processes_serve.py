"""`tandem serve` with several gateway processes around fake engines in real Ray actors
(``python -m tests.integration.processes_serve CONFIG``), for tests/integration/test_gateway_processes.py
and tandem_tools/bench/gateway_ceiling.py's kind of run."""

import functools
import sys

from gateway.config import load_config
from gateway.observability.logs import setup_logging
from gateway.processes import serve_processes
from workers.deployment import RayDeployment

if __name__ == "__main__":
    setup_logging("info")
    config = load_config(sys.argv[1])
    sys.exit(serve_processes(config, functools.partial(RayDeployment, engine_key="fake"), log_level="info"))
