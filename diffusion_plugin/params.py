"""Validation of a diffusion request's body: OpenAI fields plus the ``diffusion`` extension.

Errors are 400s in the OpenAI envelope naming the field (``diffusion.entropy_bound``...).
"""

from __future__ import annotations

import random
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gateway.errors import invalid

GREEDY_T = 1e-4  # temperature 0 means near-greedy: both ends of the schedule this low


class DiffusionKnobs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    previews: bool = Field(False, description="Stream preview chunks (the current block's argmax) between blocks.")
    max_denoising_steps: int | None = Field(None, ge=1, le=1024)
    entropy_bound: float | None = Field(None, ge=0)
    stability_threshold: int | None = Field(None, ge=0, le=64)
    confidence_threshold: float | None = Field(None, ge=0)
    t_min: float | None = Field(None, gt=0, le=100)
    t_max: float | None = Field(None, gt=0, le=100)


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: dict | None = None
    diffusion: DiffusionKnobs = Field(default_factory=DiffusionKnobs)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("up to 4 non-empty strings")
        return stops

    def stops(self) -> list[str]:
        return list(self.stop or [])

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class ChatBody(_Base):
    messages: list[dict[str, Any]] = Field(min_length=1)


class CompletionBody(_Base):
    prompt: str


def parse(cls: type[_Base], body: dict) -> _Base:
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        loc = [str(p) for p in first["loc"] if not str(p).startswith("function-")]
        field = ".".join(p for p in loc if not p.isdigit()) or None
        raise invalid(f"{'.'.join(loc) or 'body'}: {first['msg']}", param=field) from None


def resolve(req: _Base, defaults: dict[str, Any]) -> dict[str, Any]:
    """The effective per-sequence knobs: the request's, else the model's generation config."""
    knobs = {k: v for k, v in req.diffusion.model_dump(exclude={"previews"}).items() if v is not None}
    merged = {**defaults, **knobs}
    if req.temperature is not None and "t_min" not in knobs and "t_max" not in knobs:
        if req.temperature == 0:
            merged["t_min"] = merged["t_max"] = GREEDY_T
        else:  # scale the model's schedule so that it ends at `temperature`
            ratio = defaults["t_min"] / defaults["t_max"]
            merged["t_max"], merged["t_min"] = req.temperature, req.temperature * ratio
    if merged["t_min"] > merged["t_max"]:
        raise invalid("diffusion.t_min must not exceed diffusion.t_max", param="diffusion.t_min")
    merged["seed"] = req.seed if req.seed is not None else random.randrange(2**31)
    return merged

