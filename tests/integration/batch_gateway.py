"""One gateway process around in-process fake engines (no Ray, no vLLM), served as `tandem serve`
serves (``gateway.http.server.run_server``: its SIGTERM drain), for tests that stop and stall gateway
processes sharing one batch store:

    python -m tests.integration.batch_gateway CONFIG RECORD ENGINE_ARGS_JSON

When it releases its replicas (its stop) it writes RECORD (JSON): every request its fake engines
were sent, with when it arrived (``{"request id": time.time()}``): what this process served."""

import json
import sys
from pathlib import Path

from gateway.config import load_config
from gateway.http.app import build_app
from gateway.http.server import run_server
from gateway.observability.logs import setup_logging
from gateway.serving.service import Service
from workers.fake_engine import FakeDeployment


class RecordingDeployment(FakeDeployment):
    def __init__(self, engine_args: dict, record: Path):
        super().__init__(engine_args)
        self.record = record

    def close(self) -> None:
        served = {rid: t for e in self.engines.values() for rid, t in zip(e.served, e.served_at, strict=True)}
        self.record.write_text(json.dumps(served))
        super().close()


if __name__ == "__main__":
    setup_logging("info")
    config = load_config(sys.argv[1])
    service = Service(config, RecordingDeployment(json.loads(sys.argv[3]), Path(sys.argv[2])))
    run_server(build_app(service), service)
