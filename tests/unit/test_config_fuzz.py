"""Property tests of the config loader: whatever the YAML holds, loading either gives a valid
config or a ConfigError that names the file; never another exception."""

import string
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.config import ConfigError, load_config, parse_config

KEYS = ["gateway", "ray", "metrics", "auth", "limits", "cors", "models", "models_dir", "config_dir", "name", "kind",
        "source", "replicas", "resources", "num_gpus", "num_cpus", "engine_args", "env", "session_affinity",
        "enabled", "load_factor", "api_keys", "key", "key_env", "key_file", "port", "host", "max_queue",
        "health_interval_s", "stall_timeout_s", "max_body_bytes", "max_n", "allow_origins", "max_restarts"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
                    st.text(max_size=20), st.sampled_from(["autoregressive", "diffusion", "builtin:tiny-llama", "*"]))
keys = st.one_of(st.sampled_from(KEYS), st.text(string.ascii_letters + "_", max_size=12))
documents = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                          st.dictionaries(keys, inner, max_size=6)), max_leaves=30)
VALID_MODEL = {"name": "m", "kind": "autoregressive", "source": "builtin:tiny-llama"}


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(doc=documents)
def test_any_document_loads_or_is_a_config_error(doc):
    try:
        cfg = parse_config(doc, Path("fuzz.yaml"))
    except ConfigError as e:
        assert str(e).startswith("fuzz.yaml")
    else:
        assert cfg.models  # a config that loads is usable


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(overrides=st.dictionaries(st.sampled_from(KEYS), documents, max_size=4),
       model=st.dictionaries(st.sampled_from(KEYS), documents, max_size=4))
def test_near_valid_documents_load_or_name_the_field(overrides, model):
    doc = {**overrides, "models": [{**VALID_MODEL, **model}]}
    try:
        parse_config(doc, Path("fuzz.yaml"))
    except ConfigError as e:
        lines = str(e).splitlines()
        assert lines[0].startswith("fuzz.yaml") and (len(lines) > 1 or ":" in lines[0])


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(text=st.text(max_size=200))
def test_any_file_text_loads_or_is_a_config_error(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_text(text)
    try:
        load_config(path)
    except ConfigError as e:
        assert str(path) in str(e)


def test_a_missing_key_file_or_variable_is_a_config_error_without_the_key(tmp_path, monkeypatch):
    monkeypatch.delenv("TANDEM_TEST_KEYS", raising=False)
    base = {"models": [VALID_MODEL]}
    for auth, words in (({"api_keys": [{"key_file": "nope.txt"}]}, "nope.txt"),
                        ({"api_keys_env": "TANDEM_TEST_KEYS"}, "TANDEM_TEST_KEYS")):
        try:
            parse_config({**base, "auth": auth}, tmp_path / "c.yaml")
        except ConfigError as e:
            assert words in str(e) and "auth" in str(e)
        else:
            raise AssertionError("loaded a config whose key cannot be read")
    (tmp_path / "k.txt").write_text("sk-secret-value-123\n")
    cfg = parse_config({**base, "auth": {"api_keys": [{"key_file": "k.txt", "name": "ops"}]}}, tmp_path / "c.yaml")
    assert cfg.config_dir == tmp_path.resolve() and "sk-secret" not in repr(cfg)
    assert yaml.safe_dump(cfg.model_dump(mode="json")).count("sk-secret") == 0
