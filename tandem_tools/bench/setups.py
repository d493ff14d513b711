"""What each benchmark target runs: `vllm serve` direct, a Rust gateway (vllm-router, smg) in
front of one, tandem (its default channel to the replica: a TCP socket), and tandem with the
channel over Ray (``gateway.channel: ray``, what tandem did before the socket). Used by
``tandem bench`` and ``tandem_tools.bench.hoptrace``."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from tandem_tools.bench import procstat
from tandem_tools.bench.servers import Server

ENGINE_ARGS = {"enforce_eager": True, "max_model_len": 512, "max_num_seqs": 64, "dtype": "float32"}
TARGETS = ("direct", "vllm-router", "smg", "tandem")
TANDEM_RAY = "tandem-ray"  # opt-in: tandem with gateway.channel: ray (the socket channel's before)
TANDEM_TRACED = "tandem-traced"  # opt-in: tandem tracing every request (sample ratio 1) to an OTLP sink
MODEL = "tiny-llama"
ACTOR_PREFIX = "ray::EngineActor"
# Run in every Python process started with ``site_dir`` first on PYTHONPATH (Ray's workers
# inherit the environment): per-hop tracing, when the environment asks.
SITE = ('import os\nif os.environ.get("TANDEM_HOPTRACE_FILE"):\n'
        '    try:\n        import tandem_tools.bench.hoptrace as h\n        h.install()\n    except Exception as e:\n'
        '        print("hoptrace:", e)\n')


def site_dir(workdir: Path) -> Path:
    """A folder holding the ``sitecustomize`` above (put it first on PYTHONPATH)."""
    site = workdir / "site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(SITE)
    return site


@dataclass
class Setup:
    """What one target runs: ``servers`` start in order (the engine first) and stop in reverse;
    load goes to the last one."""

    name: str
    servers: list[Server]
    gateway: Server | None  # the gateway process whose CPU is reported (None: direct)
    serving: Callable[[], int | None]  # pid of vLLM's serving layer, once everything is ready


def _vllm_flags(engine_args: dict) -> list[str]:
    flags = []
    for k, v in engine_args.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            flags.append(flag)
        elif v is not False:
            flags += [flag, str(v)]
    return flags


def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def router_argv(kind: str, port: int, worker_port: int, metrics_port: int) -> list[str]:
    """A Rust gateway in front of one `vllm serve`: round robin, its metrics on a port of its own
    (both default to 29000, which another process on a shared box may hold)."""
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", f"http://127.0.0.1:{worker_port}",
              "--policy", "round_robin", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
    if kind == "vllm-router":
        return [_bin("vllm-router"), *common, "--log-level", "warning"]
    if kind == "smg":
        return [_bin("smg"), "launch", *common, "--log-level", "warn"]
    raise ValueError(f"unknown router {kind!r}")


def tandem_config(port: int, model_path: str, channel: str = "socket", traces: str | None = None) -> dict:
    """``traces``: an OTLP endpoint every request's spans go to (sample ratio 1)."""
    return {
        "gateway": {"host": "127.0.0.1", "port": port, "channel": channel},
        **({"observability": {"otlp_traces_endpoint": traces, "sample_ratio": 1.0}} if traces else {}),
        "ray": {"num_cpus": 2},
        "models": [{"name": MODEL, "kind": "autoregressive", "source": model_path,
                    "resources": {"num_gpus": 0, "num_cpus": 1}, "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
                    "engine_args": ENGINE_ARGS}],
    }


def build_setups(args, model_path: str, workdir: Path) -> dict[str, Setup]:
    """Every target's servers (``args.port``: where its load goes; a gateway's vLLM takes the next
    port and the gateway's metrics the one after)."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}

    def vllm(port: int, log: str) -> Server:
        return Server("vllm serve", [sys.executable, "-m", "tandem_tools.vllm_cli_shim", "serve", model_path,
                                     "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port),
                                     "--disable-uvicorn-access-log", *_vllm_flags(ENGINE_ARGS)],
                      port, "/v1/models", workdir / log, env)

    def tandem(name: str, channel: str, traces: str | None = None) -> Server:
        cfg_path = workdir / f"{name}.yaml"
        cfg_path.write_text(yaml.safe_dump(tandem_config(args.port, model_path, channel, traces)))
        return Server(name, [sys.executable, "-m", "tandem_tools.cli", "--log-level", "warning", "serve",
                             "--config", str(cfg_path)], args.port, "/ready", workdir / f"{name}.log", env)

    direct = vllm(args.port, "direct.log")
    setups = {"direct": Setup("direct", [direct], None, lambda: direct.proc.pid)}
    traces = getattr(args, "otlp_endpoint", None)  # (bench.main's sink, when tandem-traced runs)
    for name, channel, traced in (("tandem", "socket", None), (TANDEM_RAY, "ray", None),
                                  (TANDEM_TRACED, "socket", traces)):
        gateway = tandem(name, channel, traced)
        setups[name] = Setup(name, [gateway], gateway, lambda g=gateway: procstat.find(g.proc.pid, ACTOR_PREFIX))
    for kind in ("vllm-router", "smg"):
        engine = vllm(args.port + 1, f"{kind}-vllm.log")
        router = Server(kind, router_argv(kind, args.port, args.port + 1, args.port + 2), args.port,
                        "/v1/models", workdir / f"{kind}.log", env)
        setups[kind] = Setup(kind, [engine, router], router, lambda e=engine: e.proc.pid)
    return setups


def missing_binaries(targets: list[str]) -> list[str]:
    return [t for t in targets if t in ("vllm-router", "smg") and not Path(_bin(t)).exists()]
