"""The configuration of one served model (``models[]`` of a config file): its kind, resources,
replicas, autoscaling and engine arguments. ``tandem_core.config`` holds the rest of the file's
schema and re-exports these."""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

BUILTIN_PREFIX = "builtin:"


class Strict(BaseModel):
    """Every config section: unknown fields are errors, values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelKind(str, Enum):
    AUTOREGRESSIVE = "autoregressive"
    DIFFUSION = "diffusion"


class Resources(Strict):
    num_gpus: float = Field(1, ge=0, description="GPUs each replica holds (Ray resource); with tensor or pipeline "
                            "parallelism (engine_args tensor_parallel_size x pipeline_parallel_size > 1), GPUs per "
                            "engine worker: the replica then holds a Ray placement group of that many bundles.")
    num_cpus: float = Field(1, ge=0, description="CPUs each replica holds (Ray resource).")
    custom: dict[str, float] = Field(default_factory=dict, description="Ray custom resources each replica holds, "
                                     "e.g. {\"accelerator_type:H100\": 0.001} or a node label of your own "
                                     "(`ray start --resources`): the replica runs only on nodes that offer them.")

    @field_validator("custom")
    @classmethod
    def _custom_is_custom(cls, v: dict[str, float]) -> dict[str, float]:
        bad = sorted(k for k, n in v.items() if k in ("CPU", "GPU", "memory") or not k or n < 0)
        if bad:
            raise ValueError(f"custom resources need a name of your own and an amount >= 0 (CPU and GPU are "
                             f"num_cpus and num_gpus): {', '.join(bad)}")
        return v

    def ray_needs(self) -> dict[str, float]:
        """What one replica (or one bundle of its group) asks Ray for, zeros left out."""
        need = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.custom}
        return {k: v for k, v in need.items() if v}


class SessionAffinity(Strict):
    enabled: bool = Field(False, description="Send a session's requests to the same replica (autoregressive "
                          "models: its prefix cache holds the conversation so far).")
    header: str = Field("x-session-id", min_length=1, description="Request header carrying the session key; "
                        "without it, the body's `user` field, else its `prompt_cache_key` (OpenAI's cache routing "
                        "key), is the key.")
    load_factor: float = Field(1.25, ge=1, description="Bounded load: a session leaves its replica for the next "
                               "one in its order while that replica holds more than this times the average load.")


class AutoscalingConfig(Strict):
    min_replicas: int = Field(1, ge=1, description="Fewest replicas, kept even when idle (at least 1: no scale to "
                              "zero, a cold start takes as long as loading the model).")
    max_replicas: int = Field(ge=1, description="Most replicas the autoscaler may run.")
    target_in_flight_per_replica: float = Field(
        8, gt=0, description="Requests in flight plus queued (every gateway process's) per replica the autoscaler "
        "aims at: above it for scale_up_window_s, it scales up to load / target replicas (capped at "
        "max_replicas).")
    scale_up_window_s: float = Field(30, ge=0, description="Seconds the load must stay above the target before "
                                     "replicas are added (0: at once).")
    scale_down_window_s: float = Field(300, ge=0, description="Seconds the load must fit in one replica fewer "
                                       "(at the target) before one replica is drained and removed; each further "
                                       "step waits as long again. Never below min_replicas.")
    interval_s: float = Field(1, gt=0, description="Seconds between two looks at the load (and decisions).")

    @model_validator(mode="after")
    def _min_le_max(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must not exceed max_replicas ({self.max_replicas})")
        return self


PARALLEL_ARGS = ("tensor_parallel_size", "pipeline_parallel_size")  # vLLM's engine args


class ModelConfig(Strict):
    name: str = Field(min_length=1, description="The `model` clients ask for.")
    kind: ModelKind = Field(description="autoregressive (vLLM) or diffusion (tandem's batcher).")
    source: str = Field(
        min_length=1,
        description="A local path, a Hugging Face id, or `builtin:<name>` for a built-in tiny model.",
    )
    replicas: int = Field(1, ge=1, description="Ray actors to run, one per GPU. With autoscaling: how many to "
                          "start with (default: autoscaling.min_replicas), within min_replicas..max_replicas.")
    autoscaling: AutoscalingConfig | None = Field(
        None, description="Add and remove replicas with the load (absent: always `replicas` replicas). A removed "
        "replica is drained first: no new requests, its requests in flight finish (up to "
        "gateway.drain_timeout_s).")
    resources: Resources = Field(default_factory=Resources, description="Per-replica Ray resources.")
    aliases: list[str] = Field(default_factory=list, description="More names clients may ask for, each routed to "
                               "this model and listed by /v1/models (as `vllm serve --served-model-name NAME ALIAS "
                               "...`); answers name the model `name`, as vLLM answers with its first served name.")
    max_in_flight_per_replica: int | None = Field(
        None, ge=1, description="Requests a replica takes at once; beyond, they queue in the gateway "
        "(None: no limit, the engine queues them itself).")
    engine_args: dict[str, Any] = Field(
        default_factory=dict, description="Passed to the engine unchanged (vLLM's engine and serving args)."
    )
    env: dict[str, str] = Field(default_factory=dict, description="Environment variables for the replica's process.")
    routing: Literal["p2c", "prefix"] = Field(
        "p2c", description="How a request picks a replica: `p2c` (power of two choices on load) or `prefix` "
        "(the replica likely to hold the longest cached prefix of the prompt, within a load bound; a diffusion "
        "model needs engine_args sampler: fast, whose prefix cache is on unless prefix_cache: false).")
    session_affinity: SessionAffinity = Field(default_factory=SessionAffinity,
                                              description="Optional session affinity (autoregressive only).")
    max_tokens_ceiling: int | None = Field(
        None, ge=1, description="Largest max_tokens / max_completion_tokens a request to this model may ask for "
        "(overrides limits.max_tokens_ceiling).")
    max_restarts: int = Field(-1, ge=-1, description="How often Ray restarts a replica's actor that died or was "
                              "killed for being stuck (-1: always).")
    lora_modules: dict[str, str] = Field(
        default_factory=dict, description="Autoregressive models: LoRA adapters served on this base, name -> path "
        "(a local PEFT directory, a Hugging Face id, or `builtin:<name>`), as `vllm serve --enable-lora "
        "--lora-modules name=path`; clients pick one by `model`. vLLM's LoRA engine args (max_loras, "
        "max_lora_rank, max_cpu_loras) go in engine_args. With none here, `enable_lora: true` in engine_args "
        "still allows adapters loaded at run time (POST /v1/load_lora_adapter).")

    @model_validator(mode="before")
    @classmethod
    def _replicas_from_autoscaling(cls, data: Any) -> Any:
        """With autoscaling and no `replicas`, a model starts with min_replicas."""
        if isinstance(data, dict) and "replicas" not in data and isinstance(data.get("autoscaling"), dict):
            start = data["autoscaling"].get("min_replicas", 1)
            if isinstance(start, int) and start >= 1:  # else autoscaling.min_replicas's own error says why
                data = {**data, "replicas": start}
        return data

    @model_validator(mode="before")
    @classmethod
    def _cpu_parallelism_uses_processes(cls, data: Any) -> Any:
        """vLLM's CPU platform has no Ray executor ("current platform cpu does not support ray"),
        and vLLM picks Ray inside a placement group: a CPU replica split over several workers runs
        them as vLLM's own processes (`mp`) unless its engine_args say otherwise."""
        if not (isinstance(data, dict) and data.get("kind") == ModelKind.AUTOREGRESSIVE.value):
            return data
        resources, args = data.get("resources", {}), data.get("engine_args", {})
        gpus = resources.get("num_gpus", 1) if isinstance(resources, dict) else 1
        if not isinstance(args, dict) or gpus != 0:
            return data
        n = 1
        for key in PARALLEL_ARGS:
            v = args.get(key, 1)
            n *= v if isinstance(v, int) and v >= 1 else 1
        if n > 1 and "distributed_executor_backend" not in args:
            data = {**data, "engine_args": {**args, "distributed_executor_backend": "mp"}}
        return data

    @model_validator(mode="before")
    @classmethod
    def _diffusion_follows_its_hardware(cls, data: Any) -> Any:
        """A diffusion replica that holds a GPU runs on it, with the fast sampler (the exact one is
        HF's per-row calls, made for parity, not for a GPU), unless its engine_args say otherwise;
        its dtype (None) is then the checkpoint's. On the host: cpu, exact, float32."""
        if not (isinstance(data, dict) and data.get("kind") == ModelKind.DIFFUSION.value):
            return data
        resources, args = data.get("resources", {}), data.get("engine_args", {})
        gpus = resources.get("num_gpus", 1) if isinstance(resources, dict) else 1
        if isinstance(args, dict) and isinstance(gpus, (int, float)) and gpus > 0:
            data = {**data, "engine_args": {"device": "cuda", "sampler": "fast", **args}}
        return data

    @model_validator(mode="after")
    def _device_matches_resources(self) -> ModelConfig:
        """A diffusion model's device and the GPU its replica holds must agree: a GPU held while
        the model runs on the host (or the reverse) is a configuration that cannot be meant."""
        if self.kind is not ModelKind.DIFFUSION:
            return self
        device = str(self.engine_args.get("device", "cpu"))
        if device == "cpu" and self.resources.num_gpus > 0:
            raise ValueError(f"engine_args.device: cpu, but resources.num_gpus: {self.resources.num_gpus:g} reserves "
                             "a GPU that would stay idle; drop device (it follows num_gpus) or set "
                             "resources.num_gpus: 0")
        if device.startswith("cuda") and self.resources.num_gpus == 0:
            raise ValueError(f"engine_args.device: {device}, but resources.num_gpus: 0 holds no GPU; set "
                             "resources.num_gpus: 1 (or device: cpu)")
        return self

    @model_validator(mode="after")
    def _parallel_layout(self) -> ModelConfig:
        if self.kind is ModelKind.DIFFUSION:
            given = sorted(k for k in PARALLEL_ARGS if k in self.engine_args)
            if given:
                raise ValueError(f"engine_args.{given[0]}: a diffusion model runs on one device per replica (tensor "
                                 "and pipeline parallelism are not supported yet); add replicas instead")
            return self
        for key in PARALLEL_ARGS:
            v = self.engine_args.get(key, 1)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"engine_args.{key}: a whole number >= 1, not {v!r}")
        if "served_model_name" in self.engine_args:
            raise ValueError("engine_args.served_model_name: the names clients use are the model's `name` and "
                             "`aliases` (tandem routes by them and passes them to vLLM)")
        return self

    @property
    def devices_per_replica(self) -> int:
        """Engine workers of one replica: tensor_parallel_size x pipeline_parallel_size (1 for a
        diffusion model); above 1 the replica holds a Ray placement group of that many bundles."""
        if self.kind is not ModelKind.AUTOREGRESSIVE:
            return 1
        args = self.engine_args
        return int(args.get("tensor_parallel_size", 1)) * int(args.get("pipeline_parallel_size", 1))

    @property
    def served_names(self) -> list[str]:
        """Every name this model answers to, its own first."""
        return [self.name, *self.aliases]

    @model_validator(mode="after")
    def _replicas_within_autoscaling(self) -> ModelConfig:
        a = self.autoscaling
        if a is not None and not a.min_replicas <= self.replicas <= a.max_replicas:
            raise ValueError(f"replicas ({self.replicas}) is the initial count with autoscaling and must lie within "
                             f"autoscaling.min_replicas..max_replicas ({a.min_replicas}..{a.max_replicas})")
        return self

    @model_validator(mode="after")
    def _affinity_is_autoregressive(self) -> ModelConfig:
        if self.session_affinity.enabled and self.kind is not ModelKind.AUTOREGRESSIVE:
            raise ValueError("session_affinity: only autoregressive models have a prefix cache to keep warm")
        return self

    @model_validator(mode="after")
    def _prefix_routing_is_autoregressive(self) -> ModelConfig:
        if self.routing == "prefix" and self.kind is not ModelKind.AUTOREGRESSIVE and not (
                self.engine_args.get("sampler") == "fast" and self.engine_args.get("prefix_cache", True) is True):
            raise ValueError("routing: `prefix` routes by what a replica's prefix cache holds; a diffusion model has "
                             "one with engine_args sampler: fast (and prefix_cache not false; else use `p2c`)")
        return self

    @model_validator(mode="after")
    def _lora_is_autoregressive(self) -> ModelConfig:
        if self.lora_modules and self.kind is not ModelKind.AUTOREGRESSIVE:
            raise ValueError("lora_modules: a diffusion model takes no LoRA adapters (tandem's batcher runs its "
                             "base weights only); serve adapters on an autoregressive model")
        bad = sorted(n for n in self.lora_modules if not n or n != n.strip() or n == self.name)
        if bad:
            raise ValueError(f"lora_modules: adapter names must be non-empty, unpadded and not the base's name: {bad}")
        return self

    @property
    def lora_enabled(self) -> bool:
        """Adapters may be served on this model (configured ones, or loaded at run time)."""
        return self.kind is ModelKind.AUTOREGRESSIVE and (bool(self.lora_modules)
                                                          or self.engine_args.get("enable_lora") is True)

    @field_validator("name")
    @classmethod
    def _name_is_clean(cls, v: str) -> str:
        if v != v.strip() or v.startswith("/"):
            raise ValueError("must not start with '/' or carry surrounding spaces")
        return v

    @field_validator("aliases")
    @classmethod
    def _aliases_are_clean(cls, v: list[str]) -> list[str]:
        bad = [a for a in v if not a or a != a.strip() or a.startswith("/")]
        if bad:
            raise ValueError(f"aliases must be non-empty, unpadded and not start with '/': {bad}")
        return v

    def is_builtin(self) -> bool:
        return self.source.startswith(BUILTIN_PREFIX)

    def builtin_name(self) -> str:
        return self.source[len(BUILTIN_PREFIX) :]
