"""`tandem serve MODEL` (issue 32): vLLM's serve flags become one model's config entry; the kind
comes from the checkpoint; a flag that cannot apply is one line naming it; hardware defaults and
refusals hold at start."""

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config import ConfigError, parse_config
from tandem_tools.cli import build_parser
from tandem_tools.serve_model import ServeError, config_for

MODELS = Path(__file__).resolve().parents[2] / "models"
LLAMA, DIFFUSION = str(MODELS / "tiny-llama"), str(MODELS / "tiny-diffusiongemma")
TANDEM = str(Path(sys.executable).parent / "tandem")


def _config(*argv: str) -> dict:
    args, extra = build_parser().parse_known_args(["serve", *argv])
    return config_for(args, extra)


def test_vllm_flags_become_the_model_entry_and_names_are_aliases():
    cfg = _config(LLAMA, "--served-model-name", "tl", "a2", "--max-model-len", "512", "--dtype", "float32",
                  "--enforce-eager", "--num-gpus", "0", "-tp", "2", "--tool-call-parser", "hermes",
                  "--enable-auto-tool-choice", "--replicas", "2")
    (m,) = cfg["models"]
    assert (m["name"], m["aliases"], m["kind"], m["source"], m["replicas"]) == ("tl", ["a2"], "autoregressive",
                                                                              LLAMA, 2)
    assert m["engine_args"] == {"max_model_len": 512, "dtype": "float32", "enforce_eager": True,
                                "tensor_parallel_size": 2, "tool_call_parser": "hermes",
                                "enable_auto_tool_choice": True}
    assert m["resources"] == {"num_gpus": 0, "num_cpus": 1} and "VLLM_CPU_KVCACHE_SPACE" in m["env"]
    model = parse_config(cfg).models[0]
    assert model.served_names == ["tl", "a2"] and model.devices_per_replica == 2


def test_other_vllm_flags_pass_through_vllms_parser_and_unknown_ones_are_named():
    (m,) = _config(LLAMA, "--num-gpus", "0", "--max-num-seqs", "8", "--enable-prefix-caching")["models"]
    assert m["engine_args"]["max_num_seqs"] == 8 and m["engine_args"]["enable_prefix_caching"] is True
    with pytest.raises(ServeError, match="^--no-such-flag: not a tandem serve flag nor a vLLM serve flag"):
        _config(LLAMA, "--num-gpus", "0", "--no-such-flag", "3")


def test_the_kind_comes_from_the_checkpoint_and_a_gpu_makes_a_diffusion_model_fast_on_cuda():
    (m,) = _config(DIFFUSION, "--num-gpus", "0")["models"]
    assert (m["kind"], m["engine_args"]) == ("diffusion", {"family": "diffusiongemma"})
    on_cpu = parse_config(_config(DIFFUSION, "--num-gpus", "0")).models[0]
    assert on_cpu.engine_args == {"family": "diffusiongemma"}  # cpu, exact, float32: the engine's defaults
    on_gpu = parse_config(_config(DIFFUSION, "--num-gpus", "1")).models[0]
    assert on_gpu.engine_args == {"family": "diffusiongemma", "device": "cuda", "sampler": "fast"}
    (forced,) = _config(LLAMA, "--kind", "autoregressive", "--num-gpus", "0")["models"]
    assert forced["kind"] == "autoregressive"


@pytest.mark.parametrize("flag", [["-tp", "2"], ["--max-model-len", "64"], ["--max-num-seqs", "4"],
                                  ["--gpu-memory-utilization", "0.5"]])
def test_a_flag_a_diffusion_model_cannot_take_is_named(flag):
    with pytest.raises(ServeError) as e:
        _config(DIFFUSION, "--num-gpus", "0", *flag)
    named = "--tensor-parallel-size" if flag[0] == "-tp" else flag[0]
    assert str(e.value).startswith(f"{named}: a diffusion model does not take it")


@pytest.mark.parametrize("engine_args,resources,field", [
    ({"device": "cpu"}, {"num_gpus": 1}, "engine_args.device: cpu, but resources.num_gpus: 1"),
    ({"device": "cuda"}, {"num_gpus": 0}, "engine_args.device: cuda, but resources.num_gpus: 0"),
    ({"tensor_parallel_size": 2}, {"num_gpus": 1}, "engine_args.tensor_parallel_size: a diffusion model runs on one"),
])
def test_a_diffusion_device_that_disagrees_with_its_resources_is_one_line(engine_args, resources, field):
    with pytest.raises(ConfigError) as e:
        parse_config({"models": [{"name": "d", "kind": "diffusion", "source": "x", "engine_args": engine_args,
                                  "resources": resources}]})
    assert "\n" not in str(e.value) and f"models.0: {field}" in str(e.value), str(e.value)


def test_served_model_name_in_engine_args_and_clashing_aliases_are_refused():
    ar = {"name": "m", "kind": "autoregressive", "source": "x"}
    with pytest.raises(ConfigError, match="engine_args.served_model_name"):
        parse_config({"models": [{**ar, "engine_args": {"served_model_name": "x"}}]})
    with pytest.raises(ConfigError, match="repeated: m"):
        parse_config({"models": [ar, {**ar, "name": "n", "aliases": ["m"]}]})


@pytest.mark.parametrize("argv,line", [
    (["--served-model-name", "x"], "tandem: --served-model-name: a flag of `tandem serve MODEL`"),
    (["--config", "configs/default.yaml", LLAMA], "tandem: --config and MODEL: give one"),
    ([DIFFUSION, "--num-gpus", "0", "-tp", "2"], "tandem: --tensor-parallel-size: a diffusion model does not take it"),
    ([DIFFUSION, "--num-gpus", "1", "--port", "0"], "tandem: model '"),  # a GPU on a host without one
])
def test_serve_refuses_at_once_in_one_line(argv, line):
    done = subprocess.run([TANDEM, "serve", *argv], capture_output=True, text=True, timeout=300)
    err = [x for x in done.stderr.splitlines() if x.startswith("tandem: ")]
    assert done.returncode == 2 and len(err) == 1 and err[0].startswith(line), done.stderr[-3000:]
    assert "Traceback" not in done.stderr


def test_help_groups_the_flags():
    text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for group in ("the model (with MODEL)", "vLLM's serve flags", "the server"):
        assert group in text


def test_enforce_eager_on_a_diffusion_model_turns_compilation_off():
    """As vLLM means it (issue 50: it was accepted and dropped while compiled_vocab ran)."""
    (m,) = _config(DIFFUSION, "--num-gpus", "0", "--enforce-eager")["models"]
    assert m["engine_args"] == {"family": "diffusiongemma", "enforce_eager": True}
    from diffusion_plugin.engine_args import DiffusionEngineArgs

    fast = DiffusionEngineArgs(sampler="fast", enforce_eager=True)
    assert not fast.use_compiled_vocab and not fast.use_compiled_trunk
    assert DiffusionEngineArgs(sampler="fast").use_compiled_vocab  # the host's default it turns off
    with pytest.raises(ConfigError, match="enforce_eager: true compiles nothing"):
        parse_config({"models": [{"name": "d", "kind": "diffusion", "source": "x", "resources": {"num_gpus": 0},
                                  "engine_args": {"enforce_eager": True, "compiled_trunk": True}}]})


@pytest.mark.parametrize("eager", [True, False])
def test_a_fast_diffusion_engine_with_enforce_eager_compiles_nothing(monkeypatch, eager):
    """Over an engine's start and one request: no torch.compile asked for by the batcher, and
    dynamo's own count of the frames it compiled unchanged, with enforce_eager; without it the
    host's compiled vocabulary pass asks for one (so the check can fail; dynamo may then reuse a
    graph an earlier test compiled)."""
    import asyncio
    import sys

    import torch
    from torch._dynamo.utils import counters

    from diffusion_plugin.engine import DiffusionEngine
    from workers import tiny_models

    asked = []
    real = torch.compile

    def spy(*args, **kwargs):
        if sys._getframe(1).f_globals.get("__name__", "").startswith("diffusion_plugin"):
            asked.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "compile", spy)
    path = str(tiny_models.build(tiny_models.TINY_DIFFUSIONGEMMA))
    before = sum(counters["frames"].values())

    async def main():
        engine = DiffusionEngine("m", path, {"sampler": "fast", "enforce_eager": eager, "max_batch": 2})
        await engine.start()
        try:
            return [x async for x in engine.completions({"model": "m", "prompt": "Once", "max_tokens": 4}, "r0")]
        finally:
            await engine.shutdown()

    (answer,) = asyncio.run(main())
    assert answer["choices"][0]["finish_reason"] in ("stop", "length")
    assert (asked == []) is eager, len(asked)
    if eager:
        assert sum(counters["frames"].values()) == before
