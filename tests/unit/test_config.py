import pytest

from diffusion_plugin.api.images import ImageLimits
from gateway.config import ConfigError, load_config, parse_config

GOOD = {"models": [{"name": "m", "kind": "autoregressive", "source": "builtin:tiny-llama"}]}


def test_default_config_loads_and_names_the_tiny_model():
    cfg = load_config()
    assert [(m.name, m.kind.value) for m in cfg.models] == [("tiny-llama", "autoregressive"),
                                                           ("tiny-diffusiongemma", "diffusion")]
    assert all(m.is_builtin() and m.builtin_name() == m.name for m in cfg.models)
    assert cfg.ray.address is None


def test_defaults_are_one_gpu_per_replica():
    m = parse_config(GOOD).models[0]
    assert (m.replicas, m.resources.num_gpus, m.resources.num_cpus) == (1, 1, 1)


@pytest.mark.parametrize(
    "data, field, reason",
    [
        ({"models": []}, "models", "at least 1"),
        ({"models": [{"name": "m", "kind": "nope", "source": "x"}]}, "models.0.kind", "autoregressive"),
        ({"models": [{"name": "m", "kind": "diffusion", "source": "x", "replicas": 0}]}, "models.0.replicas", "greater than or equal to 1"),
        ({"models": [{"name": "m", "kind": "diffusion", "source": "x", "typo": 1}]}, "models.0.typo", "Extra inputs"),
        ({**GOOD, "gateway": {"port": 70000}}, "gateway.port", "less than or equal"),
        ({"models": GOOD["models"] * 2}, "models", "unique"),
        ({"models": [{"kind": "diffusion", "source": "x"}]}, "models.0.name", "Field required"),
    ],
)
def test_invalid_config_names_file_field_and_reason(tmp_path, data, field, reason):
    import yaml

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert str(path) in msg and field in msg and reason in msg, msg


def test_unreadable_and_non_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "x.yaml"
    bad.write_text("models: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- just a list\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(bad)


def test_cli_exits_non_zero_on_a_bad_config(tmp_path, capsys):
    from tandem_tools.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("models: []\n")
    assert main(["serve", "--config", str(bad)]) == 2
    assert "models" in capsys.readouterr().err


@pytest.mark.parametrize(
    "engine_args, field, reason",
    [
        ({"max_batch": 0}, "models.0.engine_args.max_batch", "greater than or equal to 1"),
        ({"boundaries": "rows"}, "models.0.engine_args.boundaries", "'block' or 'row'"),
        ({"sampler": "fastest"}, "models.0.engine_args.sampler", "'exact' or 'fast'"),
        ({"memory_budget_gib": -1}, "models.0.engine_args.memory_budget_gib", "greater than 0"),
        ({"max_batchh": 4}, "models.0.engine_args.max_batchh", "Extra inputs"),
        ({"family": "nope"}, "models.0.engine_args.family", "unknown model family 'nope'; known: diffusiongemma"),
        ({"sampler": "exact", "compiled_trunk": True, "cuda_graphs": True}, "models.0.engine_args",
         "cuda_graphs needs compiled_trunk: true, sampler: fast and a cuda device"),
        ({"sampler": "fast", "cuda_graphs": True, "device": "cuda"}, "models.0.engine_args", "compiled_trunk=False"),
    ],
)
def test_a_bad_diffusion_engine_arg_names_file_and_field(tmp_path, engine_args, field, reason):
    import yaml

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"models": [{"name": "d", "kind": "diffusion", "source": "x",
                                                "engine_args": engine_args}]}))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert str(path) in msg and field in msg and reason in msg, msg


def test_autoregressive_engine_args_pass_through_to_vllm():
    cfg = parse_config({"models": [{**GOOD["models"][0], "engine_args": {"max_model_len": 512, "anything": 1}}]})
    assert cfg.models[0].engine_args == {"max_model_len": 512, "anything": 1}  # vLLM checks its own at start


def test_diffusion_engine_args_defaults_are_the_engines():
    from diffusion_plugin.engine_args import DiffusionEngineArgs

    args = DiffusionEngineArgs()
    assert (args.family, args.max_batch, args.boundaries, args.sampler, args.dtype, args.device, args.num_threads,
            args.memory_budget_gib) == ("diffusiongemma", 16, "block", "exact", None, "cpu", None, None)
    assert args.load_dtype == "float32"  # on the host; on a device, the checkpoint's own
    assert DiffusionEngineArgs(device="cuda").load_dtype == "auto"
    assert DiffusionEngineArgs(device="cuda", dtype="float16").load_dtype == "float16"
    assert args.image_limits() == ImageLimits()
    assert all(f.description for f in DiffusionEngineArgs.model_fields.values())


def test_the_shipped_configs_load():
    from tandem_core.config import REPO_ROOT

    for path in sorted((REPO_ROOT / "configs").glob("*.yaml")):
        assert load_config(path).models, path
