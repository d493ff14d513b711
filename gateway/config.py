"""tandem's configuration: one YAML file, validated with pydantic when it is loaded.

``load_config`` is the only entry point; a bad file raises ``ConfigError`` whose message
names the file, the field and the reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from gateway.admission.keys import resolve_keys
from tandem_core.config import DEFAULT_CONFIG, TandemConfig
from workers.registry import validate_engine_args


class ConfigError(Exception):
    """A configuration file that cannot be used; the message is meant for the operator."""


def _format_errors(path: Path, err: ValidationError, prefix: tuple = ()) -> str:
    """One line for one error (`tandem serve` then fails in one line); a list for several."""
    found = [(".".join(str(p) for p in (*prefix, *e["loc"])) or "(top level)", e["msg"].removeprefix("Value error, "))
             for e in err.errors()]
    if len(found) == 1:
        return f"{path}: {found[0][0]}: {found[0][1]}"
    return "\n".join([f"{path}: invalid configuration", *(f"  {loc}: {msg}" for loc, msg in found)])


def parse_config(data: Any, path: Path = Path("<config>")) -> TandemConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    try:
        cfg = TandemConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(path, e)) from None
    _check_engine_args(cfg, path)
    if not cfg.models_dir.is_absolute():
        cfg = cfg.model_copy(update={"models_dir": (path.parent / cfg.models_dir).resolve()})
    if "config_dir" not in data:
        cfg = cfg.model_copy(update={"config_dir": path.parent.resolve()})
    try:
        resolve_keys(cfg.auth, base_dir=cfg.config_dir)  # a missing key file or variable fails now, not per request
    except ValueError as e:
        raise ConfigError(f"{path}: invalid configuration\n  auth: {e}") from None
    return cfg


def _check_engine_args(cfg: TandemConfig, path: Path) -> None:
    """Each model's engine_args against its engine's typed arguments (where the engine declares
    them: diffusion does; vLLM checks its own when the replica starts)."""
    for i, model in enumerate(cfg.models):
        where = ("models", i, "engine_args")
        try:
            validate_engine_args(model)
        except ValidationError as e:
            raise ConfigError(_format_errors(path, e, where)) from None
        except KeyError as e:
            raise ConfigError(f"{path}: invalid configuration\n  models.{i}.engine_args.family: {e.args[0]}") from None


def load_config(path: str | Path | None = None) -> TandemConfig:
    path = Path(path) if path is not None else DEFAULT_CONFIG
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    return parse_config(data, path)
