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


def _config(tmp_path: Path, engine_args: dict, env: dict | None = None) -> Path:
    import yaml

    models = str(Path(__file__).resolve().parents[2] / "models")
    cfg = {"models_dir": models, "models": [{
        "name": "tiny-llama", "kind": "autoregressive", "source": "builtin:tiny-llama",
        "resources": {"num_gpus": 0, "num_cpus": 1}, "env": {"VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})},
        "engine_args": {"enforce_eager": True, "dtype": "float32", **engine_args}}]}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_an_engine_argument_vllm_refuses_fails_serve_at_once_in_one_line(tmp_path):
    """tiny-llama's positions end at 1,024: vLLM refuses max_model_len 4096. `vllm serve` exits at
    once with its reason; so does `tandem serve`, naming the model and the field, before Ray."""
    done = subprocess.run([str(Path(sys.executable).parent / "tandem"), "serve", "--config",
                           str(_config(tmp_path, {"max_model_len": 4096}))], capture_output=True, text=True, timeout=300)
    err = [line for line in done.stderr.splitlines() if line.startswith("tandem: ")]
    assert done.returncode == 2, done.stdout + done.stderr
    assert len(err) == 1 and "model 'tiny-llama': engine_args.max_model_len: User-specified max_model_len (4096)" \
        in err[0], done.stderr
    assert "Traceback" not in done.stderr and "pickle" not in done.stderr and "starting a local Ray" not in done.stderr


def test_the_models_env_applies_to_the_check(tmp_path):
    """With the model's env allowing a longer max_model_len (as vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN
    does for the engine), the check passes; another field vLLM refuses is named."""
    from gateway.config import load_config
    from tandem_tools.cli import engine_config_problem

    ok = load_config(str(_config(tmp_path, {"max_model_len": 2048}, {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"})))
    assert engine_config_problem(ok) is None
    bad = load_config(str(_config(tmp_path, {"dtype": "float7"})))
    problem = engine_config_problem(bad)
    assert problem.startswith("model 'tiny-llama': ") and "dtype" in problem and "\n" not in problem
