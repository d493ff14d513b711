"""Engines register by kind (and, for diffusion, by model family).

Third-party engines register through the ``tandem.engines`` entry-point group: the entry
point's name is ``<kind>`` or ``<kind>:<family>`` and its value a factory
``(ModelConfig, source_path: str) -> Engine``. A new diffusion family served by tandem's engine
is one adapter module plus its line in ``diffusion_plugin.families.ADAPTERS``; neither the gateway
nor the schedulers change.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from importlib.metadata import entry_points
from typing import Any

from pydantic import BaseModel

from tandem_core.config import ModelConfig
from tandem_core.protocol import Engine

Factory = Callable[[ModelConfig, str], Engine]

# Built in; entry points may add to (or override) these. The diffusion families' keys
# (``diffusion:<family>``) come from their one registry, ``diffusion_plugin.families.ADAPTERS``.
_BUILTIN: dict[str, str] = {
    "autoregressive": "workers.vllm_engine:create_engine",
    "diffusion": "diffusion_plugin.engine:create_engine",
    "fake": "workers.fake_engine:create_engine",
}
_FAMILIES = "diffusion_plugin.families:ADAPTERS"  # (torch-free)


# Typed engine_args per engine key (a pydantic model, importable without torch); keys without one
# pass their engine_args through unchecked (vLLM checks its own when the replica builds it). Every
# built-in diffusion key, whatever its family, takes the diffusion engine's (which names the
# families ``ADAPTERS`` knows when one is not).
_ARGS: dict[str, str] = {
    "diffusion": "diffusion_plugin.engine_args:DiffusionEngineArgs",
}


def _load(target: str) -> Any:
    module, _, attr = target.partition(":")
    return getattr(import_module(module), attr)


def _plugins() -> dict[str, str]:
    return {ep.name: ep.value for ep in entry_points(group="tandem.engines")}


def available() -> dict[str, str]:
    found = dict(_BUILTIN)
    found.update({f"diffusion:{family}": _BUILTIN["diffusion"] for family in _load(_FAMILIES)})
    found.update(_plugins())
    return found


def key_for(cfg: ModelConfig) -> str:
    family = cfg.engine_args.get("family") if cfg.kind.value == "diffusion" else None
    return f"{cfg.kind.value}:{family}" if family else cfg.kind.value


def validate_engine_args(cfg: ModelConfig) -> None:
    """Called when the config loads. Raises pydantic's ValidationError (locations relative to
    ``engine_args``) for a bad field, or KeyError when no engine is registered for ``cfg``."""
    key = key_for(cfg)
    args = _ARGS.get(key) or (_ARGS["diffusion"] if key.startswith("diffusion:") and key not in _plugins() else None)
    if args is not None:
        model: type[BaseModel] = _load(args)
        model.model_validate(cfg.engine_args)
    elif key not in available():
        raise KeyError(f"no engine registered for {key!r}; registered: {sorted(available())}")


def create_engine(cfg: ModelConfig, source_path: str, key: str | None = None) -> Engine:
    """Build (not start) the engine for ``cfg``; raises KeyError naming what is known."""
    key = key or key_for(cfg)
    known = available()
    if key not in known:
        raise KeyError(f"no engine registered for {key!r}; registered: {sorted(known)}")
    return _load(known[key])(cfg, source_path)
