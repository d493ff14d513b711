"""docs/config.md is the configuration's pydantic schema, rendered (tandem_tools/config_doc.py):
the file equals the generator's output, every field of every model has its row, and the types
and defaults read as a YAML author needs them."""

from enum import Enum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, SecretStr

from diffusion_plugin.engine_args import DiffusionEngineArgs
from tandem_core.config import REPO_ROOT, TandemConfig
from tandem_tools import config_doc


def test_docs_config_md_is_the_generators_output():
    diff = config_doc.check()
    assert not diff, ("docs/config.md differs from the config schema: run "
                      "`python -m tandem_tools.config_doc --write`\n" + "".join(diff[:60]))


def _models_reachable_from(model: type[BaseModel]) -> set[type[BaseModel]]:
    """Every BaseModel the schema reaches, found by a walk of its own (not the generator's)."""
    found = {model}
    for field in model.model_fields.values():
        stack: list[Any] = [field.annotation]
        while stack:
            a = stack.pop()
            if isinstance(a, type) and issubclass(a, BaseModel) and a not in found:
                found |= _models_reachable_from(a)
            stack.extend(getattr(a, "__args__", ()))
    return found


def _rows_by_section(text: str) -> dict[str, str]:
    parts = text.split("\n## ")[1:]
    return {p.split("\n", 1)[0]: p for p in parts}


def test_every_field_of_every_model_has_a_row_in_its_section():
    sections = config_doc.sections()
    assert {s.model for s in sections} == _models_reachable_from(TandemConfig) | {DiffusionEngineArgs}
    by_title = _rows_by_section(config_doc.render())
    missing = []
    for s in sections:
        body = by_title[config_doc._title(s)]
        for name, field in s.model.model_fields.items():
            if f"| `{name}` |" not in body and f"| [`{name}`](#" not in body:
                missing.append(f"{config_doc._title(s)}: {name}")
            elif field.description and " ".join(field.description.split()).replace("|", "\\|") not in body:
                missing.append(f"{config_doc._title(s)}: {name}'s description")
    assert not missing, missing
    assert "models[].engine_args (autoregressive)" in by_title
    assert "vLLM's engine and serving arguments" in by_title["models[].engine_args (autoregressive)"]


def test_the_output_holds_nothing_of_this_machine():
    text = config_doc.render()
    assert text == config_doc.render()
    assert str(REPO_ROOT) not in text
    assert "| `models_dir` | `path` | `<repo>/models` |" in text


class _Color(str, Enum):
    RED = "red"
    BLUE = "blue"


class _Inner(BaseModel):
    x: int = 1


class _Probe(BaseModel):
    a: int | None = Field(None, ge=1)
    b: list[str] = Field(default_factory=lambda: ["/health"])
    c: dict[str, Any] = Field(default_factory=dict)
    d: Literal["p2c", "prefix"] = "p2c"
    e: _Color = _Color.RED
    f: SecretStr | None = None
    g: Path = REPO_ROOT / "models"
    h: _Inner = Field(default_factory=_Inner)
    i: list[_Inner] = Field(min_length=1)
    j: float = Field(2.0, gt=0, lt=10)
    k: str = Field("cpu", pattern=r"^(cpu|cuda)$")


def test_types_defaults_and_bounds_render_for_a_yaml_author():
    f = _Probe.model_fields
    assert [config_doc.render_type(f[n].annotation) for n in "abcdefghij"] == [
        "int | None", "list[str]", "dict[str, Any]", '"p2c" | "prefix"', '"red" | "blue"', "str (secret) | None",
        "path", "_Inner", "list[_Inner]", "float"]
    assert [config_doc.render_default(f[n]) for n in "abcdeghij"] == [
        "`null`", '`["/health"]`', "`{}`", '`"p2c"`', '`"red"`', "`<repo>/models`", "see below", "required",
        "`2`"]
    assert config_doc.render_constraints(f["a"]) == ">= 1"
    assert config_doc.render_constraints(f["i"]) == "at least 1 long"
    assert config_doc.render_constraints(f["j"]) == "> 0, < 10"
    assert config_doc.render_constraints(f["k"]) == "matches `^(cpu|cuda)$`"
    assert config_doc.nested_model(f["i"].annotation) is _Inner
    assert config_doc.anchor("models[].engine_args (diffusion)") == "modelsengine_args-diffusion"


def test_check_reports_a_stale_file(tmp_path):
    stale = tmp_path / "config.md"
    stale.write_text(config_doc.render().replace("| `max_batch` |", "| `max_batches` |"))
    diff = "".join(config_doc.check(stale))
    assert "-| `max_batches` |" in diff and "+| `max_batch` |" in diff
    stale.write_text(config_doc.render())
    assert config_doc.check(stale) == []
