"""The engine protocol: what every engine (vLLM, the diffusion batcher, the fake) implements.

An engine lives inside a worker (a Ray actor, or in-process in unit tests). The gateway never
sees an engine directly; it talks to the actor shell in ``workers/actor.py``.

Routes: each generation route of the gateway (``ROUTES``) is one engine method of the same
name (``chat``, ``completions``, ``responses``, ``tokenize``...). An engine serves a route iff it
has that method: the actor reports them (``EngineInfo.routes``) and the gateway answers 400,
naming the route and the model, for any other. Adding a route to an engine is one method.

What a route method yields (``Item``), in order:
- a ``TandemError``: the request failed before it produced output (exactly one item); or
- a ``dict``: the whole body of a non-streaming response (exactly one item); or
- ``str`` SSE text (``"data: {...}\\n\\n"``, one or more events each) for a streaming request,
  the last one ending in ``"data: [DONE]\\n\\n"`` (chat, completions: OpenAI's framing; the
  Responses and Anthropic streams have named events and no ``[DONE]``: they end with the
  iterator). A failure after the stream began is a ``TandemError`` item (or, on chat and
  completions, an error event followed by ``[DONE]``), never a bare stop.
Cancelling the iterator (client gone) aborts the request in the engine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from tandem_core.errors import TandemError, invalid

Route = Literal["chat", "completions", "responses", "responses_retrieve", "responses_cancel", "messages",
                "messages_count_tokens", "tokenize", "detokenize"]
# route -> (HTTP method, path) as clients call it: names routes in errors and in the OpenAPI document.
ROUTES: dict[str, tuple[str, str]] = {
    "chat": ("POST", "/v1/chat/completions"),
    "completions": ("POST", "/v1/completions"),
    "responses": ("POST", "/v1/responses"),
    "responses_retrieve": ("GET", "/v1/responses/{response_id}"),
    "responses_cancel": ("POST", "/v1/responses/{response_id}/cancel"),
    "messages": ("POST", "/v1/messages"),
    "messages_count_tokens": ("POST", "/v1/messages/count_tokens"),
    "tokenize": ("POST", "/tokenize"),
    "detokenize": ("POST", "/detokenize"),
}
# Routes whose streams are OpenAI's ``data: ...`` events ending in ``[DONE]``.
DONE_ROUTES = frozenset({"chat", "completions"})
# Routes that generate tokens (the others cost the gateway's token budgets only their input).
GENERATING_ROUTES = frozenset({"chat", "completions", "responses", "messages"})
Item = TandemError | dict | str
DONE = "data: [DONE]\n\n"


@dataclass(frozen=True)
class EngineInfo:
    """What the gateway needs to know about a started engine (shown in /v1/models)."""

    model: str
    kind: str
    max_model_len: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    routes: tuple[str, ...] | None = None  # the ``ROUTES`` it serves (set by the actor); None: unknown


def served_routes(engine: object) -> tuple[str, ...]:
    """The routes ``engine`` serves: those it has a method for."""
    return tuple(r for r in ROUTES if callable(getattr(engine, r, None)))


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


class ReplicaHandle(Protocol):
    """How the gateway reaches one replica (``workers/transport/handles.py`` implements it).
    ``generate`` yields the request's ``Item``s; past ``timeout_at`` (event-loop time) it ends
    with a 504 and aborts the request in the engine."""

    on_broken: Callable[[TandemError], None] | None  # set by the service: the channel broke

    def generate(self, route: str, body: dict, request_id: str,
                 timeout_at: float | None = None) -> AsyncIterator[Item]: ...
    async def abort(self, request_id: str) -> bool: ...
    async def health(self) -> ReplicaHealth: ...
    async def stats(self) -> EngineStats: ...
    async def reset_prefix_cache(self) -> bool: ...
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
