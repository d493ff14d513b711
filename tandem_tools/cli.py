"""The ``tandem`` command: serve, build-tiny-models, bench (the top floor: it composes the
gateway, the workers and the tools; nothing imports it)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from gateway.config import ConfigError, load_config, parse_config
from gateway.http.app import build_app
from gateway.http.server import run_server
from gateway.observability.logs import setup_logging
from gateway.serving.service import Service
from tandem_core.config import DEFAULT_CONFIG
from tandem_core.protocol import Role
from tandem_tools import serve_model
from tandem_tools.bench import diffusion as bench_diffusion
from tandem_tools.bench import diffusion_prefix as bench_diffusion_prefix
from tandem_tools.bench import main as bench
from tandem_tools.bench import prefix as bench_prefix
from tandem_tools.serve_model import ServeError
from workers import tiny_models
from workers.deployment import RayDeployment

logger = logging.getLogger("tandem")




def cmd_serve(args: argparse.Namespace) -> int:
    try:
        config = _serve_config(args)
    except (ConfigError, ServeError) as e:
        print(f"tandem: {e}", file=sys.stderr)
        return 2
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port), ("processes", args.processes))
                 if v is not None}
    if overrides.get("processes", 1) < 1:
        print("tandem: --processes must be at least 1", file=sys.stderr)
        return 2
    gw = config.gateway.model_copy(update=overrides)
    config = config.model_copy(update={"gateway": gw})
    if args.otlp_traces_endpoint:
        config = config.model_copy(update={"observability": config.observability.model_copy(
            update={"otlp_traces_endpoint": args.otlp_traces_endpoint})})
    if args.attach and not config.ray.address:
        print("tandem: --attach joins the replicas another `tandem serve` runs on a Ray cluster: set ray.address "
              "in the config (e.g. `auto` on a node of that cluster)", file=sys.stderr)
        return 2

    logger.info("config %s: %d model(s): %s", args.config or DEFAULT_CONFIG, len(config.models),
                ", ".join(f"{m.name} ({m.kind.value}, {m.replicas} replica(s))" for m in config.models))
    problem = None if args.attach else engine_config_problem(config)
    if problem:
        print(f"tandem: {problem}", file=sys.stderr)
        return 2
    if gw.processes > 1:
        from gateway.processes import serve_processes

        return serve_processes(config, ray_deployment, owner=not args.attach, log_level=args.log_level,
                               access_log=args.access_log, log_format=args.log_format)
    # One process. The port first, before Ray starts its own processes (any of which may take a free
    # port): a port in use fails here, in one line. On a cluster (ray.address) the replicas are
    # named actors, so that `tandem serve --attach` on other nodes can serve them too; locally they
    # are anonymous, as always.
    from gateway.processes import bind_socket

    try:
        sock = bind_socket(gw.host, gw.port)
    except OSError as e:
        print(f"tandem: cannot listen on {gw.host}:{gw.port}: {e.strerror or e}", file=sys.stderr)
        return 2
    role = Role.ATTACHED if args.attach else Role.OWNER if config.ray.address else Role.SOLO
    service = Service(config, ray_deployment(config, role=role), metrics_port=True)  # (attached: its own)
    logger.info("tandem listening on http://%s:%d/v1 (models load in the background; GET /ready)",
                gw.host, gw.port)
    run_server(build_app(service), service, log_level=args.log_level, sockets=[sock])
    if service.fatal:
        print(f"tandem: {service.fatal}", file=sys.stderr)
        return 2
    return 0


def _serve_config(args: argparse.Namespace):
    """The config to serve: --config's file, or the one model of `tandem serve MODEL`."""
    extra = getattr(args, "extra", [])
    if args.model is None:
        given = [f for f, v in (("--served-model-name", args.served_model_name), ("--kind", args.kind))
                 if v is not None] + [f"--{k.replace('_', '-')}" for k in serve_model.VLLM_FLAGS
                                      if getattr(args, k) is not None] + extra
        if given:
            raise ServeError(f"{given[0]}: a flag of `tandem serve MODEL` (name the model; with --config, set it "
                             "in the file)")
        return load_config(args.config)
    if args.config:
        raise ServeError("--config and MODEL: give one (a config file serves several models; MODEL, one)")
    return parse_config(serve_model.config_for(args, extra), Path("tandem serve " + args.model))


def engine_config_problem(config) -> str | None:
    """vLLM's own check of each autoregressive model with a local source (a built-in or a
    directory), before anything starts: the first refusal, in one line, else None. A hub id is
    left to its replica's engine (its config would be fetched), which fails in one line too."""
    from tandem_core.config import ModelKind
    from tandem_core.errors import EngineConfigError
    from workers.deployment import resolve_source
    from workers.vllm_support import check_engine_args

    for m in config.models:
        if m.kind is not ModelKind.AUTOREGRESSIVE:
            continue
        source = resolve_source(m, config.models_dir)
        if not Path(source).is_dir():
            continue
        try:
            check_engine_args(m.name, source, m.engine_args, m.env)
        except EngineConfigError as e:
            return str(e)
    return None


def ray_deployment(config, role: str = "solo") -> RayDeployment:
    """The replicas as Ray actors (module-level: the gateway processes unpickle it)."""
    return RayDeployment(config, role=role)


def cmd_build_tiny_models(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out else tiny_models.DEFAULT_DIR
    only = [n.strip() for n in args.only.split(",")] if args.only else None
    unknown = sorted(set(only or []) - set(tiny_models.BUILDERS))
    if unknown:
        print(f"tandem: unknown built-in model(s) {', '.join(unknown)}; known: {', '.join(tiny_models.BUILDERS)}",
              file=sys.stderr)
        return 2
    for path in tiny_models.build_all(out, force=args.force, only=only):
        print(path)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.mode == "diffusion":
        return bench_diffusion.main(args)
    if args.mode == "prefix":
        return bench_prefix.main(args)
    if args.mode == "diffusion-prefix":
        return bench_diffusion_prefix.main(args)
    if args.mode == "tenants":
        from tandem_tools.bench import tenants as bench_tenants

        return bench_tenants.main(args.extra)
    if args.mode == "batch":
        from tandem_tools.bench import batch as bench_batch

        return bench_batch.main(args.extra)
    if args.mode == "decisions":
        from tandem_tools.bench import decisions as bench_decisions

        return bench_decisions.main(args.extra)
    return bench.main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="One OpenAI-compatible gateway for autoregressive (vLLM) and block-diffusion LLMs, on Ray.",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="log verbosity (default: info)")
    parser.add_argument("--log-format", default="text", choices=["text", "json"],
                        help="log lines as text (default) or as JSON objects, one per line (ts, level, logger, "
                             "message, and the access fields)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="serve a model, or the models of a config, over the OpenAI API",
                           usage="tandem serve [MODEL] [flags]",
                           description="`tandem serve MODEL` serves one model (a local checkpoint or a Hugging "
                                       "Face id) at http://HOST:PORT/v1, as `vllm serve MODEL` does: an "
                                       "autoregressive one through vLLM, a block-diffusion one (detected from its "
                                       "config.json) through tandem's batcher. `tandem serve --config FILE` serves "
                                       "several. With neither, configs/default.yaml: the built-in tiny models "
                                       "(built on first use), on a local Ray, offline. Other configs: "
                                       "configs/diffusion-shape.yaml, configs/qwen-gpu.yaml (real models on GPU "
                                       "nodes); every field: docs/config.md.")
    serve_model.add_arguments(serve)
    g = serve.add_argument_group("the server")
    g.add_argument("--config", metavar="FILE", help=f"YAML config of several models (default without MODEL: "
                   f"{DEFAULT_CONFIG.relative_to(DEFAULT_CONFIG.parent.parent)})")
    g.add_argument("--host", help="bind address (overrides gateway.host; default 127.0.0.1)")
    g.add_argument("--port", type=int, help="port (overrides gateway.port; default 8000)")
    g.add_argument("--processes", type=int, metavar="N", help="gateway processes sharing the port and the "
                   "replicas (overrides gateway.processes; default 1)")
    g.add_argument("--attach", action="store_true", help="serve the replicas that the `tandem serve` of "
                   "another node created and supervises, on the cluster of ray.address (one per node)")
    g.add_argument("--otlp-traces-endpoint", metavar="URL", help="export a trace per request (OpenTelemetry, "
                   "OTLP over HTTP, or gRPC for grpc://HOST:PORT), as `vllm serve`'s flag (overrides "
                   "observability.otlp_traces_endpoint)")
    g.add_argument("--access-log", action="store_true", help="log one line per request: its id (X-Request-Id), "
                   "method, path, status, model, tenant, key, queue time, time to first byte, total time, tokens "
                   "in and out")
    serve.set_defaults(func=cmd_serve)

    build = sub.add_parser("build-tiny-models", help="build the built-in tiny models (random weights)",
                           description="Build the built-in tiny models deterministically (fixed seed, a BPE "
                                       "trained on text shipped in the repo). `serve` does this when missing.")
    build.add_argument("--out", metavar="DIR", help="output directory (default: ./models in the repo)")
    build.add_argument("--force", action="store_true", help="rebuild even if an up-to-date build exists")
    build.add_argument("--only", metavar="NAMES", help="comma-separated models to build (default: tiny-llama, "
                       "tiny-diffusiongemma, and shape-diffusiongemma, DiffusionGemma's real canvas and vocabulary "
                       "on a tiny trunk, ~170 MB; shape-diffusiongemma-deep, the same on 8 layers 1,024 wide, "
                       "~1.9 GB, only when named here or by a config or benchmark)")
    build.set_defaults(func=cmd_build_tiny_models)

    bench_parser = sub.add_parser("bench", help="benchmark tandem against its peer on the same machine",
                                  description="Run the same streaming chat load against tandem and `vllm serve` "
                                       "on the same tiny model, in one run, and print the ratios. With --mode "
                                       "diffusion: tandem's diffusion batcher (exact and fast samplers, block and "
                                       "row boundaries) against HF generate(), sequential and static batches.")
    bench.add_arguments(bench_parser)
    bench_diffusion.add_arguments(bench_parser)
    bench_prefix.add_arguments(bench_parser)
    bench_diffusion_prefix.add_arguments(bench_parser)
    bench_parser.set_defaults(func=cmd_bench)

    from tandem_tools import run_batch

    rb = sub.add_parser("run-batch", help="answer a batch file of OpenAI requests (as `vllm run-batch`)",
                        usage="tandem run-batch -i IN.jsonl -o OUT.jsonl (--url URL | MODEL [flags] | --config FILE)",
                        description="Answer a batch file of OpenAI request lines ({custom_id, method, url, body}) "
                                    "into one output file, one answer per line in input order, as `vllm run-batch` "
                                    "does, through tandem's serving path: the Batch API of a running tandem (--url), "
                                    "or of one started for MODEL (with `tandem serve MODEL`'s flags) or --config "
                                    "FILE and stopped after. Lines of several endpoints: one batch each.")
    run_batch.add_arguments(rb)
    rb.set_defaults(func=run_batch.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not (args.command in ("serve", "run-batch") and args.model is not None) and not (
            args.command == "bench" and args.mode in ("tenants", "batch", "decisions")):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra  # `tandem serve MODEL`: vLLM's other serve flags (serve_model.vllm_flags checks them)
    setup_logging(args.log_level, args.log_format, access_log=getattr(args, "access_log", False))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
