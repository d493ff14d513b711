"""The engine protocol: what every engine (vLLM, the diffusion batcher, the fake) implements.

An engine lives inside a worker (a Ray actor, or in-process in unit tests). The gateway never
sees an engine directly; it talks to the actor shell in ``workers/actor.py``.

Routes: each engine route of the gateway (``ROUTE_TABLE``, ``engine=True``) is one engine
method of the same name (``chat``, ``completions``, ``responses``, ``tokenize``...). An engine serves a route iff it
has that method: the actor reports them (``EngineInfo.routes``) and the gateway answers 400,
naming the route and the model, for any other. Adding a route to an engine is one method.

What a route method yields (``Item``), in order:
- a ``TandemError``: the request failed before it produced output (exactly one item); or
- a ``dict``: the whole body of a non-streaming response (exactly one item); or
- ``str`` SSE text (``"data: {...}\\n\\n"``, one or more events each) for a streaming request,
  the last one ending in ``"data: [DONE]\\n\\n"`` (chat, completions: OpenAI's framing; the
  Responses and Anthropic streams have named events and no ``[DONE]``: they end with the
  iterator). A failure after the stream began is a ``TandemError`` item, never a bare stop:
  errors are values on this side; the gateway frames them for the route, once
  (``gateway/http/streaming.py``).
Cancelling the iterator (client gone) aborts the request in the engine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol, runtime_checkable

from tandem_core.errors import TandemError, invalid


@dataclass(frozen=True)
class RouteSpec:
    """One HTTP route of the gateway. ``engine``: served by the engine method named ``name``;
    ``generates``: it generates tokens (the others cost the gateway's token
    budgets only their input); ``done``: its streams are OpenAI's ``data:`` events ending in
    ``[DONE]``; ``timed``: its duration is a histogram (``tandem_request_duration_seconds``);
    ``doc``: its description in the OpenAPI document; ``admin``: only an admin key may call it
    (with auth on: operators' routes that show every tenant or change shared state). Every path
    here is its own ``route`` label in the metrics (others: ``other``)."""

    name: str
    method: str
    path: str
    engine: bool = False
    generates: bool = False
    done: bool = False
    timed: bool = False
    doc: str = ""
    admin: bool = False
    priority: bool = False  # its engine takes the request's priority in the body (as a generating route's)


# The one route table: the app registers the engine routes from it, metrics take their labels from it.
ROUTE_TABLE: tuple[RouteSpec, ...] = (
    RouteSpec("chat", "POST", "/v1/chat/completions", engine=True, generates=True, done=True, timed=True,
              doc="Chat completion (OpenAI's API): streamed as server-sent events with `stream: true`."),
    RouteSpec("completions", "POST", "/v1/completions", engine=True, generates=True, done=True, timed=True,
              doc="Text completion (OpenAI's API): streamed as server-sent events with `stream: true`."),
    RouteSpec("responses", "POST", "/v1/responses", engine=True, generates=True, timed=True,
              doc="Create a response (OpenAI's Responses API): streamed as named server-sent events with "
                  "`stream: true`. Both model kinds."),
    RouteSpec("responses_retrieve", "GET", "/v1/responses/{response_id}", engine=True,
              doc="A stored response (the replica that created it serves it; vLLM stores responses only when "
                  "its replica runs with `VLLM_ENABLE_RESPONSES_API_STORE=1`)."),
    RouteSpec("responses_cancel", "POST", "/v1/responses/{response_id}/cancel", engine=True,
              doc="Cancel a background response (on the replica that created it)."),
    RouteSpec("messages", "POST", "/v1/messages", engine=True, generates=True, timed=True,
              doc="Anthropic's Messages API (errors in Anthropic's shape). Both model kinds: vLLM's conversion "
                  "around the chat route."),
    RouteSpec("messages_count_tokens", "POST", "/v1/messages/count_tokens", engine=True,
              doc="Anthropic's token count of a Messages request."),
    RouteSpec("decisions", "POST", "/v1/decisions", engine=True, timed=True, priority=True,
              doc="OpenAI's Decisions API: 1-400 predicate, choice and score questions about one input, answered "
                  "in order with probabilities read from the model's label logprobs (both model kinds)."),
    RouteSpec("systemone", "POST", "/v1/systemone", engine=True, timed=True, priority=True,
              doc="vLLM's structured decisions route: vLLM's own serving object on autoregressive models (501 "
                  "where vLLM has no read strategy for the architecture); label reads in vLLM's shape on "
                  "diffusion models."),
    RouteSpec("tokenize", "POST", "/tokenize", engine=True,
              doc="The token ids of a prompt, or of chat messages under the model's chat template."),
    RouteSpec("detokenize", "POST", "/detokenize", engine=True, doc="The text of token ids."),
    # vLLM's pooling routes (an embedding, classification or scoring model: vLLM's pooling runner)
    RouteSpec("embeddings", "POST", "/v1/embeddings", engine=True,
              doc="Embeddings (OpenAI's API): `input` a string, strings, token ids or lists of them; "
                  "`encoding_format` float or base64; `dimensions` on models that allow it."),
    RouteSpec("pooling", "POST", "/pooling", engine=True, doc="vLLM's raw pooling output of a pooling model."),
    RouteSpec("classify", "POST", "/classify", engine=True, doc="vLLM's classification route (a "
              "classification model)."),
    RouteSpec("score", "POST", "/score", engine=True, doc="vLLM's score route: the similarity of text pairs."),
    RouteSpec("score_v1", "POST", "/v1/score", engine=True, doc="vLLM's score route, under /v1."),
    RouteSpec("rerank", "POST", "/rerank", engine=True, doc="vLLM's rerank route (Jina and Cohere's API)."),
    RouteSpec("rerank_v1", "POST", "/v1/rerank", engine=True, doc="vLLM's rerank route, under /v1."),
    RouteSpec("version", "GET", "/version", doc="The vLLM version serving autoregressive models (as `vllm serve` "
              "answers)."),
    RouteSpec("models", "GET", "/v1/models", doc="The served models (and their replicas' limits)."),
    RouteSpec("model", "GET", "/v1/models/{model_id:path}", doc="One served model."),
    RouteSpec("metrics", "GET", "/metrics", doc="Prometheus metrics (when no separate metrics port is set)."),
    RouteSpec("replicas", "GET", "/admin/replicas", admin=True,
              doc="Each replica's state and its engine's own counters "
              "(running requests...); per model, the replicas desired (autoscaling) vs running, pending and "
              "draining."),
    RouteSpec("reset_prefix_cache", "POST", "/reset_prefix_cache", admin=True,
              doc="vLLM's route (its dev mode): each live "
              "replica (of `model`, else of every model) drops the cached prompt pages no request holds. "
              "`{\"success\": false}` while running requests still hold cached pages, as vLLM answers: retry."),
    RouteSpec("load_lora_adapter", "POST", "/v1/load_lora_adapter", admin=True,
              doc="vLLM's route: load a LoRA adapter "
              "(`lora_name`, `lora_path`; tandem: `model` names the base when several serve adapters) onto every "
              "replica of its base model, and onto replicas that start later or restart."),
    RouteSpec("unload_lora_adapter", "POST", "/v1/unload_lora_adapter", admin=True,
              doc="vLLM's route: unload a LoRA adapter "
              "(`lora_name`) from every replica of its base model."),
    RouteSpec("usage", "GET", "/admin/usage", admin=True, doc="Requests and tokens (as the clients' `usage` "
              "said) per tenant and per API key, by model, summed over every gateway process."),
    RouteSpec("files_create", "POST", "/v1/files", doc="Upload a file (OpenAI's Files API; multipart `file` and "
              "`purpose`; a batch's input is JSONL, up to `batches.max_file_bytes`)."),
    RouteSpec("files_list", "GET", "/v1/files", doc="The files of the caller's tenant (`purpose`, `limit`, `after`, "
              "`order`)."),
    RouteSpec("file", "GET", "/v1/files/{file_id}", doc="One file."),
    RouteSpec("file_delete", "DELETE", "/v1/files/{file_id}", doc="Delete a file."),
    RouteSpec("file_content", "GET", "/v1/files/{file_id}/content", doc="A file's bytes."),
    RouteSpec("batches_create", "POST", "/v1/batches", doc="Create a batch (OpenAI's Batch API): its lines run on "
              "the running models at `batches.priority`, below every online request; durable across restarts."),
    RouteSpec("batches_list", "GET", "/v1/batches", doc="The batches of the caller's tenant, newest first "
              "(`after`, `limit`)."),
    RouteSpec("batch", "GET", "/v1/batches/{batch_id}", doc="One batch: its status, timestamps, counts, usage "
              "and files."),
    RouteSpec("batch_cancel", "POST", "/v1/batches/{batch_id}/cancel", doc="Cancel a batch: it ends `cancelled` "
              "with the lines finished so far."),
    RouteSpec("health", "GET", "/health", doc="Liveness: the gateway process answers."),
    RouteSpec("ready", "GET", "/ready", doc="Readiness: some model has a healthy replica (a model without one "
              "answers its own requests 503, never taking the others out of service); `?model=NAME` (repeatable): "
              "each named model has one. 503 otherwise, and while draining. The body says each model's state and "
              "`all_ready`."),
)
ROUTE_SPECS: dict[str, RouteSpec] = {r.name: r for r in ROUTE_TABLE}
# Engine routes: name -> (HTTP method, path) as clients call it (names routes in errors).
ROUTES: dict[str, tuple[str, str]] = {r.name: (r.method, r.path) for r in ROUTE_TABLE if r.engine}
DONE_ROUTES = frozenset(r.name for r in ROUTE_TABLE if r.done)
GENERATING_ROUTES = frozenset(r.name for r in ROUTE_TABLE if r.generates)
PRIORITY_ROUTES = frozenset(r.name for r in ROUTE_TABLE if r.generates or r.priority)
Item = TandemError | dict | str
DONE = "data: [DONE]\n\n"
# The tenant of a request without an API key (auth off): admission orders by it, the metrics label it.
DEFAULT_TENANT = "anonymous"


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One request as it crosses the hop to a replica: built once by the gateway from its
    request record (``gateway/request/envelope.py``), the same for a route handler and a batch job.
    The engine serves ``body`` (which carries vLLM's ``priority`` when the gateway set one);
    the rest says who asked and by when, for the replica's logs, traces and order."""

    route: str  # a route of ``ROUTE_TABLE`` the engine serves
    body: dict
    request_id: str  # the engine's id (unique among its requests)
    priority: int = 0  # vLLM's: lower is more urgent
    tenant: str | None = None  # whose share it counts to (None: auth is off)
    key: str | None = None  # the API key's configured name (never the key)
    deadline: float | None = None  # wall-clock time (``time.time()``) when the gateway gives up on it
    trace: dict[str, str] | None = None  # W3C trace context (``traceparent``, ``tracestate``) to continue


class Role(str, Enum):
    """Who owns a deployment's replicas: said once, by the deployment (``Deployment.role``).
    ``solo``: one gateway process, which owns them; ``owner``: it owns them and other gateway
    processes serve them too; ``attached``: another process owns them (this one serves requests
    on them, but never creates, restarts or shuts one down)."""

    SOLO = "solo"
    OWNER = "owner"
    ATTACHED = "attached"

    @property
    def owns(self) -> bool:
        """Restarts (and finally shuts down) the replicas it reaches."""
        return self is not Role.ATTACHED

    @property
    def shared(self) -> bool:
        """Other gateway processes may serve these replicas (and follow the owner's table)."""
        return self is not Role.SOLO


@dataclass(frozen=True)
class EngineInfo:
    """What the gateway needs to know about a started engine (shown in /v1/models)."""

    model: str
    kind: str
    max_model_len: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    routes: tuple[str, ...] | None = None  # the ``ROUTES`` it serves (set by the actor); None: unknown


def served_routes(engine: object) -> tuple[str, ...]:
    """The routes ``engine`` serves: those it has a method for, and, once started, that its
    model supports (``engine.routes_served``: a generative model serves no embeddings)."""
    supported = getattr(engine, "routes_served", None)
    return tuple(r for r in ROUTES if callable(getattr(engine, r, None)) and (supported is None or r in supported))


def route_name(route: str) -> str:
    method, path = ROUTES.get(route, ("POST", route))
    return f"{method} {path}"


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's own view of its work."""

    running: int  # requests the engine holds (scheduled or waiting inside the engine)
    waiting: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    # A counter that grows whenever the engine does work (tokens prefilled or generated, denoise
    # steps). Readiness compares it over time: work held and no progress means stuck.
    progress: int = 0


@dataclass(frozen=True)
class ReplicaHealth:
    """A replica's answer to a health check (``EngineActor.health``)."""

    incarnation: str  # new each time the actor process is (re)created
    started: bool  # the engine was started in this incarnation
    in_flight: int  # requests the replica is running for its callers
    progress: int  # ``EngineStats.progress``


@runtime_checkable
class Engine(Protocol):
    async def start(self) -> EngineInfo:
        """Called once, before any request. Loads the model; returns when it can serve."""

    def chat(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        """Serve one OpenAI chat completion request (the raw JSON body)."""

    def completions(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        """Serve one OpenAI completion request (the raw JSON body)."""

    async def abort(self, request_id: str) -> bool:
        """Abort a request the engine holds; False if it holds none of that id."""

    async def check_health(self) -> None:
        """Return if the engine can serve; raise if it cannot (the replica is then unhealthy)."""

    async def stats(self) -> EngineStats:
        """The engine's own counters, read without side effects."""

    async def reset_prefix_cache(self) -> bool:
        """Drop every cached prompt page no request holds (vLLM's ``/reset_prefix_cache``); False
        while running requests still hold cached pages (as vLLM: the caller may retry)."""

    async def shutdown(self) -> None:
        """Release the model and every process the engine started."""

    # Optional: ``async def lora(op, body) -> str`` ("load": vLLM's LoadLoRAAdapterRequest body,
    # "unload": its UnloadLoRAAdapterRequest body), vLLM's answer text or a TandemError; an engine
    # without it takes no adapters.


class ReplicaHandle(Protocol):
    """How the gateway reaches one replica (``workers/transport/handles.py`` implements it).
    ``generate`` yields the request's ``Item``s; past ``timeout_at`` (event-loop time) it ends
    with a 504 and aborts the request in the engine."""

    on_broken: Callable[[TandemError], None] | None  # set by the service: the channel broke
    channel_id: str  # this gateway process's channel to the replica (its per-channel counts say whose)

    def generate(self, request: EngineRequest, timeout_at: float | None = None) -> AsyncIterator[Item]: ...
    async def abort(self, request_id: str) -> bool: ...
    async def health(self) -> ReplicaHealth: ...
    async def stats(self) -> EngineStats: ...
    async def reset_prefix_cache(self) -> bool: ...
    async def lora(self, op: str, body: dict) -> str: ...
    async def start(self) -> EngineInfo: ...
    async def restart(self, kill: bool) -> EngineInfo: ...
    def fail_in_flight(self, err: TandemError) -> None: ...
    async def describe(self) -> dict: ...
    async def shutdown(self) -> None: ...


def route_not_served(route: str, model: str, kind: str, routes: tuple[str, ...]) -> TandemError:
    """The 400 for a route the model's engine has no method for (the gateway says the same)."""
    served = ", ".join(route_name(r) for r in routes) or "none"
    return invalid(f"{route_name(route)} is not served by model {model!r} (kind: {kind}); "
                   f"it serves: {served}", param="model")
