"""A configuration that cannot work fails at start, in one line: a replica whose engine refuses its
configuration on its first start stops `tandem serve` (exit 2, the caller prints the line), and the
line survives Ray's wrapping of the replica's exception."""

import threading

from gateway.config import parse_config
from gateway.http.app import build_app
from gateway.http.server import run_server
from gateway.serving.service import Service
from tandem_core.errors import EngineConfigError, config_error_line, engine_config_line
from tests.unit.gateway_server import free_port
from workers.fake_engine import FakeDeployment


def test_a_replica_refusing_its_configuration_at_first_start_stops_the_server():
    config = parse_config({"gateway": {"port": free_port(), "health_interval_s": 0.2},
                           "models": [{"name": "fake", "kind": "autoregressive", "source": "none", "replicas": 2}]})
    service = Service(config, FakeDeployment({"fail": "config"}))
    server = threading.Thread(target=run_server, args=(build_app(service), service), daemon=True)
    server.start()
    server.join(60)
    assert not server.is_alive(), "the server kept running with no replica that can start"
    assert service.fatal == "model 'fake': engine_args.fail: the fake engine refuses its config"
    assert all(r.last_error == service.fatal for r in service.router.all_replicas())


def test_the_line_survives_rays_wrapping():
    from ray.exceptions import RayTaskError

    cause = EngineConfigError("model 'm': engine_args.max_model_len: too long")
    wrapped = RayTaskError("EngineActor.start", "Traceback (most recent call last):\n  ...", cause).as_instanceof_cause()
    assert isinstance(wrapped, EngineConfigError) and "too long" not in str(wrapped)  # Ray prints its own
    assert engine_config_line(wrapped) == "model 'm': engine_args.max_model_len: too long"
    assert engine_config_line(RuntimeError("x")) is None


def test_a_validation_error_becomes_one_line_naming_the_field():
    from pydantic import BaseModel, model_validator

    class Args(BaseModel):  # as vLLM's ModelConfig: a model validator (no field in the location)
        max_model_len: int

        @model_validator(mode="after")
        def _short(self):
            raise ValueError("User-specified max_model_len (4096) is greater than\n   the derived one.")

    try:
        Args(max_model_len=4096)
    except Exception as e:  # noqa: BLE001
        line = config_error_line("m", {"enforce_eager": True, "max_model_len": 4096}, e)
    assert line == "model 'm': engine_args.max_model_len: User-specified max_model_len (4096) is greater than the " \
                   "derived one."
    assert config_error_line("m", {}, ValueError("no such\nthing")) == "model 'm': no such thing"
