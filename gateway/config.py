"""tandem's configuration: one YAML file, validated with pydantic when it is loaded.

``load_config`` is the only entry point; a bad file raises ``ConfigError`` whose message
names the file, the field and the reason.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gateway.auth import resolve_keys
from gateway.security import AuthConfig, CorsConfig, LimitsConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "configs" / "default.yaml"
BUILTIN_PREFIX = "builtin:"


class ConfigError(Exception):
    """A configuration file that cannot be used; the message is meant for the operator."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelKind(str, Enum):
    AUTOREGRESSIVE = "autoregressive"
    DIFFUSION = "diffusion"


class Resources(_Strict):
    num_gpus: float = Field(1, ge=0, description="GPUs each replica holds (Ray resource).")
    num_cpus: float = Field(1, ge=0, description="CPUs each replica holds (Ray resource).")


class SessionAffinity(_Strict):
    enabled: bool = Field(False, description="Send a session's requests to the same replica (autoregressive "
                          "models: its prefix cache holds the conversation so far).")
    header: str = Field("x-session-id", min_length=1, description="Request header carrying the session key; "
                        "without it, the body's `user` field is the key.")
    load_factor: float = Field(1.25, ge=1, description="Bounded load: a session leaves its replica for the next "
                               "one in its order while that replica holds more than this times the average load.")


class ModelConfig(_Strict):
    name: str = Field(min_length=1, description="The `model` clients ask for.")
    kind: ModelKind = Field(description="autoregressive (vLLM) or diffusion (tandem's batcher).")
    source: str = Field(
        min_length=1,
        description="A local path, a Hugging Face id, or `builtin:<name>` for a built-in tiny model.",
    )
    replicas: int = Field(1, ge=1, description="Ray actors to run, one per GPU.")
    resources: Resources = Field(default_factory=Resources, description="Per-replica Ray resources.")
    max_in_flight_per_replica: int | None = Field(
        None, ge=1, description="Requests a replica takes at once; beyond, they queue in the gateway "
        "(None: no limit, the engine queues them itself).")
    engine_args: dict[str, Any] = Field(
        default_factory=dict, description="Passed to the engine unchanged (vLLM's engine and serving args)."
    )
    env: dict[str, str] = Field(default_factory=dict, description="Environment variables for the replica's process.")
    session_affinity: SessionAffinity = Field(default_factory=SessionAffinity,
                                              description="Optional session affinity (autoregressive only).")
    max_tokens_ceiling: int | None = Field(
        None, ge=1, description="Largest max_tokens / max_completion_tokens a request to this model may ask for "
        "(overrides limits.max_tokens_ceiling).")
    max_restarts: int = Field(-1, ge=-1, description="How often Ray restarts a replica's actor that died or was "
                              "killed for being stuck (-1: always).")

    @model_validator(mode="after")
    def _affinity_is_autoregressive(self) -> ModelConfig:
        if self.session_affinity.enabled and self.kind is not ModelKind.AUTOREGRESSIVE:
            raise ValueError("session_affinity: only autoregressive models have a prefix cache to keep warm")
        return self

    @field_validator("name")
    @classmethod
    def _name_is_clean(cls, v: str) -> str:
        if v != v.strip() or v.startswith("/"):
            raise ValueError("must not start with '/' or carry surrounding spaces")
        return v

    def is_builtin(self) -> bool:
        return self.source.startswith(BUILTIN_PREFIX)

    def builtin_name(self) -> str:
        return self.source[len(BUILTIN_PREFIX) :]


class GatewayConfig(_Strict):
    host: str = Field("127.0.0.1", description="Address the HTTP server binds.")
    port: int = Field(8000, ge=0, le=65535, description="Port the HTTP server binds (0: any free port).")
    health_interval_s: float = Field(5, gt=0, description="Seconds between replica health checks.")
    health_timeout_s: float | None = Field(
        None, gt=0, description="A health check slower than this fails (default: health_interval_s).")
    unhealthy_after: int = Field(2, ge=1, description="Consecutive failed health checks that take a replica out "
                                 "of rotation (it is then restarted).")
    stall_timeout_s: float = Field(
        60, gt=0, description="A replica that holds requests but has made no progress (tokens, denoise steps) "
        "for this long is stuck: its requests fail and it is restarted.")
    max_queue: int = Field(256, ge=0, description="Requests per model that may wait for a replica slot; "
                           "beyond, 429 with Retry-After.")
    drain_timeout_s: float = Field(30, ge=0, description="On SIGTERM: how long in-flight requests may take to "
                                   "finish (readiness is false and new requests are refused meanwhile).")
    avoid_engine_cores: bool = Field(
        True,
        description="On CPU nodes, keep the gateway off the cores vLLM's CPU worker is pinned to (replica "
        "frontends always do). No effect on GPU nodes.",
    )


class MetricsConfig(_Strict):
    port: int | None = Field(
        None, ge=1, le=65535,
        description="Serve /metrics on this port only (own listener), instead of on the API port.")
    host: str = Field("127.0.0.1", description="Address of the separate metrics listener.")


class RayConfig(_Strict):
    address: str | None = Field(
        None, description="Absent: start a local Ray. `auto` or an address: join that cluster."
    )
    num_cpus: int | None = Field(None, ge=1, description="CPUs of a local Ray (default: enough for every replica).")


class TandemConfig(_Strict):
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig, description="API keys and their rate limits (off "
                             "by default: without keys every request is served).")
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="Input limits and the request timeout.")
    cors: CorsConfig = Field(default_factory=CorsConfig, description="CORS for browser clients (off by default).")
    config_dir: Path = Field(Path("."), description="Where relative paths in the config (key files) are resolved; "
                             "set by the loader to the config file's folder.")
    models: list[ModelConfig] = Field(min_length=1, description="The models to serve.")
    models_dir: Path = Field(REPO_ROOT / "models", description="Where built-in tiny models are built.")

    @field_validator("models")
    @classmethod
    def _unique_names(cls, models: list[ModelConfig]) -> list[ModelConfig]:
        names = [m.name for m in models]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"model names must be unique; repeated: {', '.join(dupes)}")
        return models

    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)

    def limits_for(self, model: str) -> LimitsConfig:
        """The input limits of one model: the global ones with its own max_tokens ceiling."""
        m = self.model(model)
        if m is None or m.max_tokens_ceiling is None:
            return self.limits
        return self.limits.model_copy(update={"max_tokens_ceiling": m.max_tokens_ceiling})


def _format_errors(path: Path, err: ValidationError) -> str:
    lines = [f"{path}: invalid configuration"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        lines.append(f"  {loc}: {e['msg']}")
    return "\n".join(lines)


def parse_config(data: Any, path: Path = Path("<config>")) -> TandemConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    try:
        cfg = TandemConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(path, e)) from None
    if not cfg.models_dir.is_absolute():
        cfg = cfg.model_copy(update={"models_dir": (path.parent / cfg.models_dir).resolve()})
    if "config_dir" not in data:
        cfg = cfg.model_copy(update={"config_dir": path.parent.resolve()})
    try:
        resolve_keys(cfg.auth, base_dir=cfg.config_dir)  # a missing key file or variable fails now, not per request
    except ValueError as e:
        raise ConfigError(f"{path}: invalid configuration\n  auth: {e}") from None
    return cfg


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
