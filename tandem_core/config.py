"""The configuration's types: one YAML file's schema (pydantic), shared by every package.

Loading and validating a file is ``gateway.config.load_config``; these classes are what it
returns and what workers and engines receive. Every field has a description (``tandem
config --help`` and the docs read them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from tandem_core.model_config import (  # noqa: F401 - re-exported: the config's types live here for everyone
    BUILTIN_PREFIX,
    PARALLEL_ARGS,
    AutoscalingConfig,
    ModelConfig,
    ModelKind,
    Resources,
    SessionAffinity,
)
from tandem_core.model_config import Strict as _Strict

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "configs" / "default.yaml"
MiB = 1024 * 1024


class ApiKey(_Strict):
    key: SecretStr | None = Field(None, description="The key itself (prefer key_env or key_file: configs get shared).")
    key_env: str | None = Field(None, min_length=1, description="An environment variable that holds the key.")
    key_file: Path | None = Field(None, description="A file that holds the key (surrounding whitespace is stripped); "
                                  "a relative path is relative to the config file's folder.")
    name: str | None = Field(None, min_length=1, pattern=r"^\S(.*\S)?$",
                             description="Shown in logs and messages instead of the key. Default: `key-<i>`, i "
                             "being the 0-based position in auth.api_keys.")
    requests_per_minute: int | None = Field(None, ge=1, description="Requests this key may make per minute "
                                            "(burst: a minute's worth). None: auth.default_requests_per_minute.")
    tokens_per_minute: int | None = Field(None, ge=1, description="Estimated tokens (prompt chars / 4 + max output "
                                          "tokens x n) this key may spend per minute. None: "
                                          "auth.default_tokens_per_minute.")
    role: Literal["user", "admin"] = Field("user", description="user: the API; admin: also the operators' routes "
                                           "(/admin/*, /reset_prefix_cache, LoRA load and unload), which answer a "
                                           "user key 403.")
    tenant: str | None = Field(None, min_length=1, pattern=r"^\S(.*\S)?$", description="The tenant whose usage this "
                               "key's requests count to (several keys may share one). Default: the key's name.")
    priority: int = Field(0, description="The priority of this key's requests that name none (vLLM's `priority`: "
                          "lower is more urgent; e.g. 10 for a bulk key): admission serves more urgent requests "
                          "first, and the engines schedule by it.")
    min_priority: int | None = Field(None, description="The most urgent priority this key may use: a request asking "
                                     "for a more urgent one is raised to it, never refused. None: any.")
    weight: float = Field(1.0, gt=0, description="This key's tenant's share of a model's slots against other tenants "
                          "of the same priority (weighted fair shares: weights 1 and 3 get 1:3 when both wait; a "
                          "tenant alone gets every slot). Keys of one tenant must agree.")
    models: list[str] | None = Field(None, description="The models (names, aliases, configured LoRA adapters) this "
                                     "key may call; any other is a 404, as if it did not exist, and /v1/models lists "
                                     "only these. None: every model.")

    @model_validator(mode="after")
    def _priority_within_bound(self) -> ApiKey:
        if self.min_priority is not None and self.priority < self.min_priority:
            raise ValueError(f"priority ({self.priority}) is more urgent than min_priority ({self.min_priority})")
        return self

    @model_validator(mode="after")
    def _exactly_one_source(self) -> ApiKey:
        given = [n for n in ("key", "key_env", "key_file") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of key, key_env, key_file (got {', '.join(given) or 'none'})")
        return self


class AuthConfig(_Strict):
    api_keys: list[ApiKey] = Field(default_factory=list, description="The keys clients may send. With neither "
                                   "api_keys nor api_keys_env, auth is off and every request is served.")
    api_keys_env: str | None = Field(None, min_length=1, description="An environment variable holding more keys, "
                                     "comma-separated; named `<VAR>[<i>]`, with the default limits.")
    public_paths: list[str] = Field(default_factory=lambda: ["/health"], description="Paths served without a key "
                                    "(exact match; add /metrics here for an unauthenticated scraper).")
    ready_public: bool = Field(True, description="Serve /ready without a key too (load balancers probe it).")
    default_requests_per_minute: int | None = Field(None, ge=1, description="Requests per minute of a key that "
                                                    "names none. None: no limit.")
    default_tokens_per_minute: int | None = Field(None, ge=1, description="Estimated tokens per minute of a key "
                                                  "that names none. None: no limit.")

    @model_validator(mode="after")
    def _check(self) -> AuthConfig:
        names = [k.name for k in self.api_keys if k.name is not None]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"API key names must be unique; repeated: {', '.join(dupes)}")
        bad = [p for p in self.public_paths if not p.startswith("/")]
        if bad:
            raise ValueError(f"public paths must start with '/': {', '.join(bad)}")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.api_keys) or self.api_keys_env is not None

    def public(self) -> frozenset[str]:
        return frozenset([*self.public_paths, *(["/ready"] if self.ready_public else [])])


class LimitsConfig(_Strict):
    max_body_bytes: int | None = Field(4 * MiB, ge=1, description="Largest request body in bytes; beyond, 413. "
                                       "None: no limit.")
    max_messages: int | None = Field(1024, ge=1, description="Most messages in a chat request, and prompts in a "
                                     "batched completions request. None: no limit.")
    max_tokens_ceiling: int | None = Field(None, ge=1, description="Largest max_tokens / max_completion_tokens a "
                                           "request may ask for. None: only the model's context length bounds it.")
    max_n: int | None = Field(16, ge=1, description="Largest n (and best_of): choices generated per request. "
                              "None: no limit.")
    max_prompt_chars: int | None = Field(1_000_000, ge=1, description="Most characters of prompt or message text "
                                         "in one request (token-id prompts are left to the engine's context "
                                         "check). None: no limit.")
    max_json_depth: int = Field(32, ge=4, description="Deepest nesting of the JSON body (OpenAI requests need "
                                "under 10; deeper is 400 before anything recurses over it).")
    request_timeout_s: float | None = Field(600, gt=0, description="Wall-clock limit on one request, queueing and "
                                            "generation included; the app enforces it. None: no limit.")


class CorsConfig(_Strict):
    allow_origins: list[str] = Field(default_factory=list, description="Origins that may call the API from a "
                                     "browser ('*': any). Empty: CORS is off.")
    allow_methods: list[str] = Field(default_factory=lambda: ["GET", "POST", "OPTIONS"],
                                     description="Methods a cross-origin request may use.")
    allow_headers: list[str] = Field(default_factory=lambda: ["*"], description="Request headers a cross-origin "
                                     "request may send ('*' echoes what the preflight asks, Authorization included).")
    expose_headers: list[str] = Field(default_factory=lambda: ["Retry-After", "X-Request-Id"],
                                      description="Response headers a browser script may read.")
    allow_credentials: bool = Field(False, description="Allow cookies / HTTP auth (never with origin '*').")
    max_age: int = Field(600, ge=0, description="Seconds a browser may cache a preflight answer.")

    @model_validator(mode="after")
    def _no_credentials_for_any_origin(self) -> CorsConfig:
        if self.allow_credentials and "*" in self.allow_origins:
            raise ValueError("allow_credentials cannot be used with allow_origins '*'")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.allow_origins)

    def middleware_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of starlette's ``CORSMiddleware``."""
        return self.model_dump()



class GatewayConfig(_Strict):
    processes: int = Field(1, ge=1, description="Gateway processes serving the same port and the same replicas "
                           "(one host; on several nodes, run one `tandem serve` per node against the cluster).")
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
    priority_reserve: int = Field(1, ge=0, description="Slots of each replica (of max_in_flight_per_replica) that "
                                  "requests of priority > 0 (bulk) may not take, so that a request of priority <= 0 "
                                  "finds one free under a bulk flood (at most max_in_flight_per_replica - 1).")
    promote_after_s: float | None = Field(30, gt=0, description="A request waiting this long in the gateway's "
                                          "queue goes before every priority (oldest first): nothing starves. None: "
                                          "never promoted.")
    drain_timeout_s: float = Field(30, ge=0, description="On SIGTERM: how long in-flight requests may take to "
                                   "finish (readiness is false and new requests are refused meanwhile).")
    channel: Literal["socket", "ray"] = Field(
        "socket",
        description="How requests and their tokens travel between a gateway process and a replica: `socket` "
        "(one TCP connection per gateway process and replica; Ray still places, starts, health-checks and "
        "restarts the replica) or `ray` (one Ray streaming call per gateway process and replica).")
    avoid_engine_cores: bool = Field(
        True,
        description="On CPU nodes, keep the gateway off the cores vLLM's CPU worker is pinned to (replica "
        "frontends always do). No effect on GPU nodes.",
    )


LEASE_POLLS = 3  # batches.lease_s >= this many poll_s: two renewals may be late and the lease still holds


def default_data_dir() -> Path:
    """Where durable state lives unless ``batches.data_dir`` says: ``$XDG_STATE_HOME/tandem``, else
    ``~/.local/state/tandem`` (the XDG base directory for state; read here, once)."""
    import os

    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "tandem"


class BatchesConfig(_Strict):
    enabled: bool = Field(True, description="Serve OpenAI's Files and Batch API (`/v1/files`, `/v1/batches`).")
    data_dir: Path | None = Field(None, description="Where the batch jobs' SQLite database and the uploaded and "
                                  "produced files live, across restarts (None: $XDG_STATE_HOME/tandem, else "
                                  "~/.local/state/tandem).")
    priority: int = Field(1000, description="The priority of batch lines (vLLM's field, lower is more urgent): "
                          "below every online request, whose priority (and every key's) must be lower.")
    lines_in_flight: int = Field(16, ge=1, description="Lines of one batch sent at once (admission and the "
                                 "engines queue them behind online requests).")
    max_file_bytes: int = Field(200 * 1024 * 1024, ge=1, description="Largest upload to /v1/files (its own body "
                                "limit; other routes keep limits.max_body_bytes). OpenAI's: 200 MB.")
    max_lines: int = Field(50_000, ge=1, description="Lines a batch's input file may have (OpenAI's: 50,000).")
    lease_s: float = Field(10, gt=0, description="A gateway process runs a batch while it renews its lease (every "
                           "poll_s); a batch whose runner died or stalled (its lease lapsed) is taken over and "
                           "resumed, and the runner that lost it can no longer store an answer (a fenced lease). At "
                           "least 3 x poll_s, so that a renewal a poll late keeps it.")
    poll_s: float = Field(1, gt=0, description="How often a gateway process looks for batches to run, renews its "
                          "leases, and a running batch for a cancel or its expiry.")

    @model_validator(mode="after")
    def _lease_outlives_polls(self):
        if self.lease_s < LEASE_POLLS * self.poll_s:
            raise ValueError(f"lease_s ({self.lease_s:g}) must be at least {LEASE_POLLS} x poll_s "
                             f"({self.poll_s:g}): a lease renewed every poll_s would lapse between renewals")
        return self

    @property
    def directory(self) -> Path:
        """``data_dir``, or the default state folder."""
        return self.data_dir if self.data_dir is not None else default_data_dir()


class ObservabilityConfig(_Strict):
    otlp_traces_endpoint: str | None = Field(
        None, description="Where spans go, OTLP over HTTP/protobuf (http://HOST:4318/v1/traces) or gRPC "
        "(grpc://HOST:4317), as `vllm serve --otlp-traces-endpoint`. None: the OTEL_EXPORTER_OTLP_TRACES_ENDPOINT "
        "(or OTEL_EXPORTER_OTLP_ENDPOINT) environment variable, else tracing is off (and costs nothing).")
    sample_ratio: float = Field(1.0, ge=0, le=1, description="The share of new traces sampled; a request that "
                                "arrives with a sampled `traceparent` is always traced (parent-based).")
    capture_content: bool = Field(False, description="Record prompts and outputs in the spans "
                                  "(gen_ai.input.messages, gen_ai.output.messages; off: they may hold personal data). "
                                  "A streamed chat or completion's output is recorded as each choice's joined text; "
                                  "a streamed Responses or Messages output is not recorded.")


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
    gateway: GatewayConfig = Field(default_factory=GatewayConfig, description="The HTTP server, health checks, "
                                   "queueing and draining.")
    ray: RayConfig = Field(default_factory=RayConfig, description="Which Ray to run on: a local one, or a cluster "
                           "to join.")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="Where /metrics is served.")
    auth: AuthConfig = Field(default_factory=AuthConfig, description="API keys and their rate limits (off "
                             "by default: without keys every request is served).")
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="Input limits and the request timeout.")
    cors: CorsConfig = Field(default_factory=CorsConfig, description="CORS for browser clients (off by default).")
    observability: ObservabilityConfig = Field(default_factory=ObservabilityConfig, description="Tracing "
                                               "(OpenTelemetry), off by default.")
    batches: BatchesConfig = Field(default_factory=BatchesConfig, description="OpenAI's Files and Batch API: "
                                   "durable jobs served at the lowest priority on the running models.")
    config_dir: Path = Field(Path("."), description="Where relative paths in the config (key files) are resolved; "
                             "set by the loader to the config file's folder.")
    models: list[ModelConfig] = Field(min_length=1, description="The models to serve.")
    models_dir: Path = Field(REPO_ROOT / "models", description="Where built-in tiny models are built.")

    @field_validator("models")
    @classmethod
    def _unique_names(cls, models: list[ModelConfig]) -> list[ModelConfig]:
        names = [n for m in models for n in m.served_names]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"model names and aliases must be unique; repeated: {', '.join(dupes)}")
        adapters = [a for m in models for a in m.lora_modules]  # (API keys' `models` are checked in TandemConfig)
        clash = sorted({a for a in adapters if adapters.count(a) > 1 or a in names})
        if clash:
            raise ValueError(f"a LoRA adapter's name must name no model nor another adapter: {', '.join(clash)}")
        return models

    @model_validator(mode="after")
    def _key_models_exist(self) -> TandemConfig:
        known = {n for m in self.models for n in (*m.served_names, *m.lora_modules)}
        for i, key in enumerate(self.auth.api_keys):
            unknown = sorted(set(key.models or ()) - known)
            if unknown:
                raise ValueError(f"auth.api_keys.{i}.models: not a model, alias or adapter of this config: "
                                 f"{', '.join(unknown)}")
        return self

    @model_validator(mode="after")
    def _one_weight_per_tenant(self) -> TandemConfig:
        weights: dict[str, float] = {}
        for i, key in enumerate(self.auth.api_keys):
            tenant = key.tenant or key.name or f"key-{i}"
            if weights.setdefault(tenant, key.weight) != key.weight:
                raise ValueError(f"auth.api_keys.{i}.weight: tenant {tenant!r} has keys of weights "
                                 f"{weights[tenant]:g} and {key.weight:g}; give its keys one weight")
        return self

    @model_validator(mode="after")
    def _batches_below_online(self) -> TandemConfig:
        if not self.batches.enabled:
            return self
        for i, key in enumerate(self.auth.api_keys):
            for field in ("priority", "min_priority"):
                value = getattr(key, field)
                if value is not None and value >= self.batches.priority:
                    raise ValueError(f"auth.api_keys.{i}.{field}: {value} is not more urgent than batch lines "
                                     f"(batches.priority {self.batches.priority}); lower it or raise that")
        return self

    def model(self, name: str) -> ModelConfig | None:
        """The model ``name`` names (its name, not an alias)."""
        return next((m for m in self.models if m.name == name), None)

    def limits_for(self, model: str) -> LimitsConfig:
        """The input limits of one model: the global ones with its own max_tokens ceiling."""
        m = self.model(model)
        if m is None or m.max_tokens_ceiling is None:
            return self.limits
        return self.limits.model_copy(update={"max_tokens_ceiling": m.max_tokens_ceiling})
