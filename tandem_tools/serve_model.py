"""`tandem serve MODEL`: one model from the command line, as `vllm serve MODEL` takes it.

The flags are vLLM's serve flags, meaning what they mean there; they become one model's entry of
a tandem config (``models[0]``), validated as any config is. The kind comes from the checkpoint's
``architectures`` (a block-diffusion class tandem has a family for: diffusion; anything else:
autoregressive, through vLLM); ``--kind`` overrides it. For an autoregressive model, any other
vLLM serve flag (``--max-num-seqs 64``, ``--enable-prefix-caching``...) is parsed by vLLM's own
argument parser and passed on; one vLLM does not know is an error that names it, as is a vLLM
flag given to a diffusion model (nothing is silently dropped).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from diffusion_plugin.families import family_of

KINDS = ("autoregressive", "diffusion")
CPU_KV_GIB = "4"  # an autoregressive model's KV cache on a host without GPU, unless VLLM_CPU_KVCACHE_SPACE says
# Flags a diffusion model takes, and where they go in its engine_args.
DIFFUSION_FLAGS = {"dtype": "dtype", "tool_call_parser": "tool_call_parser", "reasoning_parser": "reasoning_parser",
                   "enforce_eager": "enforce_eager"}


class ServeError(Exception):
    """A command line that cannot work; the message is one line for the operator."""


def add_arguments(serve: argparse.ArgumentParser) -> None:
    """The flags of `tandem serve MODEL`, in groups (``tandem serve --help``)."""
    serve.add_argument("model", nargs="?", metavar="MODEL", help="a local checkpoint directory or a Hugging Face "
                       "id: serve this one model (as `vllm serve MODEL`); without it, the models of --config")
    m = serve.add_argument_group("the model (with MODEL)")
    m.add_argument("--kind", choices=KINDS, help="autoregressive (vLLM) or diffusion (tandem's batcher); default: "
                   "from the checkpoint's config.json `architectures`")
    m.add_argument("--served-model-name", nargs="+", metavar="NAME", help="the names clients use: the first is the "
                   "model's, the others aliases (default: MODEL as given)")
    m.add_argument("--replicas", type=int, metavar="N", help="replicas (default 1), each on --num-gpus GPUs "
                   "(x TP x PP)")
    m.add_argument("--num-gpus", type=float, metavar="N", help="GPUs per replica (per engine worker with TP/PP > 1); "
                   "default: 1 where this host (or, with --ray-address, the cluster) has a GPU, else 0")
    m.add_argument("--num-cpus", type=float, metavar="N", help="CPUs per replica (default 1)")
    m.add_argument("--ray-address", metavar="ADDR", help="join this Ray cluster (`auto` on one of its nodes); "
                   "default: a local Ray")
    v = serve.add_argument_group("vLLM's serve flags (with MODEL; any other vLLM flag passes to an "
                                 "autoregressive model's engine)")
    v.add_argument("--tensor-parallel-size", "-tp", type=int, metavar="N", help="GPUs a replica's model is split "
                   "over (a Ray placement group of N bundles on one node); autoregressive only")
    v.add_argument("--pipeline-parallel-size", "-pp", type=int, metavar="N", help="pipeline stages (x TP bundles "
                   "in the group); autoregressive only")
    v.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16", "half", "float"),
                   help="weights' dtype (auto: the checkpoint's on a GPU; float32 for a diffusion model on the CPU)")
    v.add_argument("--max-model-len", type=int, metavar="N", help="context length (autoregressive)")
    v.add_argument("--gpu-memory-utilization", type=float, metavar="F", help="share of a GPU's memory vLLM may use "
                   "(autoregressive)")
    v.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs or compilation, as "
                   "vLLM means it (a diffusion model: compiled_vocab, compiled_trunk and cuda_graphs off)")
    v.add_argument("--enable-lora", action="store_true", default=None, help="serve LoRA adapters (autoregressive)")
    v.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH", help="adapters to serve on the model")
    v.add_argument("--enable-auto-tool-choice", action="store_true", default=None,
                   help="tool_choice \"auto\" (with --tool-call-parser; a diffusion model needs only the parser)")
    v.add_argument("--tool-call-parser", metavar="NAME", help="vLLM's tool parser (e.g. hermes, gemma4)")
    v.add_argument("--reasoning-parser", metavar="NAME", help="vLLM's reasoning parser (e.g. qwen3, gemma4)")


def architectures(model: str) -> list[str]:
    """The checkpoint's ``architectures`` (its config.json: the directory's, else the hub's)."""
    path = Path(model)
    if path.is_dir():
        file = path / "config.json"
        if not file.is_file():
            raise ServeError(f"{model}: no config.json in that directory; pass --kind")
    else:
        try:
            from huggingface_hub import hf_hub_download

            file = Path(hf_hub_download(model, "config.json"))
        except Exception as e:  # noqa: BLE001 - offline, gated, no such repo: one line
            raise ServeError(f"{model}: not a local directory, and its config.json could not be read from the hub "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); pass --kind, "
                             "or set HF_TOKEN for a gated model") from None
    try:
        found = json.loads(file.read_text()).get("architectures") or []
    except (OSError, ValueError) as e:
        raise ServeError(f"{file}: cannot read it as JSON: {e}") from None
    return [a for a in found if isinstance(a, str)]


def gpus_here(ray_address: str | None) -> int:
    """GPUs this host has (or, joining a cluster, assume GPU nodes: 1)."""
    if ray_address:
        return 1
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def model_entry(args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    """``models[0]`` of the config `tandem serve MODEL ...` means; ServeError in one line."""
    model = args.model
    kind = args.kind
    family = None
    if kind is None or kind == "diffusion":
        family = family_of(architectures(model)) if kind is None or Path(model).is_dir() else None
        kind = kind or ("diffusion" if family else "autoregressive")
    names = args.served_model_name or [model.lstrip("/") or model]
    gpus = args.num_gpus if args.num_gpus is not None else (1 if gpus_here(args.ray_address) else 0)
    entry: dict[str, Any] = {"name": names[0], "aliases": names[1:], "kind": kind,
                             "source": str(Path(model).resolve()) if Path(model).is_dir() else model,
                             "replicas": args.replicas or 1,
                             "resources": {"num_gpus": gpus, "num_cpus": args.num_cpus if args.num_cpus is not None
                                           else 1}}
    if args.lora_modules:
        pairs = [m.partition("=") for m in args.lora_modules]
        bad = [a for a, eq, b in pairs if not (a and eq and b)]
        if bad:
            raise ServeError(f"--lora-modules: NAME=PATH pairs, not {bad[0]!r}")
        entry["lora_modules"] = {a: b for a, _, b in pairs}
    given = {k: v for k, v in vars(args).items() if k in VLLM_FLAGS and v is not None}
    if kind == "diffusion":
        return _diffusion(entry, given, extra, family)
    engine_args = {k: v for k, v in given.items() if k not in ("lora_modules",)}
    if engine_args.get("dtype") in ("half", "float"):
        engine_args["dtype"] = {"half": "float16", "float": "float32"}[engine_args["dtype"]]
    if extra:
        engine_args.update(vllm_flags(extra))
    entry["engine_args"] = engine_args
    if not gpus and "gpu_memory_utilization" not in engine_args:
        # vLLM's CPU backend reserves gpu_memory_utilization (0.92) of the host's memory for its KV
        # cache unless told a size: a fixed one leaves room for everything else on the host.
        entry["env"] = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE") or CPU_KV_GIB}
    return entry


VLLM_FLAGS = ("tensor_parallel_size", "pipeline_parallel_size", "dtype", "max_model_len", "gpu_memory_utilization",
              "enforce_eager", "enable_lora", "lora_modules", "enable_auto_tool_choice", "tool_call_parser",
              "reasoning_parser")


def _diffusion(entry: dict, given: dict, extra: list[str], family: str | None) -> dict:
    """A diffusion model's entry: the flags it takes go to its engine_args; the others are errors."""
    refused = [k for k in given if k not in DIFFUSION_FLAGS and k != "enable_auto_tool_choice"]
    if refused or extra:
        flag = f"--{refused[0].replace('_', '-')}" if refused else extra[0]
        why = ("one device per replica: tensor and pipeline parallelism are not supported yet; add --replicas"
               if refused and refused[0].endswith("parallel_size") else "it is a vLLM engine flag")
        raise ServeError(f"{flag}: a diffusion model does not take it ({why}); its engine_args are "
                         "diffusion_plugin/engine_args.py's (use --config for them)")
    args = {DIFFUSION_FLAGS[k]: v for k, v in given.items() if k in DIFFUSION_FLAGS}
    if args.get("dtype") in ("auto", None):
        args.pop("dtype", None)  # the checkpoint's on a GPU, float32 on the CPU
    elif args["dtype"] in ("half", "float"):
        args["dtype"] = {"half": "float16", "float": "float32"}[args["dtype"]]
    if family:
        args["family"] = family
    return {**entry, "engine_args": args}


def vllm_flags(extra: list[str]) -> dict[str, Any]:
    """The engine args that vLLM's own serve parser makes of ``extra`` (those differing from its
    defaults); ServeError naming a flag it does not know."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="tandem serve"))
    defaults = vars(parser.parse_args(["--model", "m"]))
    try:
        parsed, unknown = parser.parse_known_args(["--model", "m", *extra])
    except SystemExit:
        raise ServeError(f"vLLM's serve flags refused {' '.join(extra)} (see `tandem serve --help` and vLLM's "
                         "`vllm serve --help`)") from None
    if unknown:
        raise ServeError(f"{unknown[0]}: not a tandem serve flag nor a vLLM serve flag")
    return {k: v for k, v in vars(parsed).items() if k != "model" and v != defaults.get(k)}


def config_for(args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    """The whole config `tandem serve MODEL` serves (the defaults for everything but the model)."""
    config: dict[str, Any] = {"models": [model_entry(args, extra)]}
    if args.ray_address:
        config["ray"] = {"address": args.ray_address}
    return config
