"""One record per request, built once at the edge and carried to the engine.

Whatever asks (a route handler from an HTTP request, a batch job from one line of its input
file) builds an ``Envelope`` with ``envelope``: the body read once (``gateway.request.intake``), who asks
(the API key, its tenant and the request's priority: ``Claim``), by when (the request timeout
and the client's queue deadline), the trace context to continue, and the routing hints
(session key; the prefix blocks and adapter are the pool's to derive). ``gateway.serving.serve``
then needs nothing else: no HTTP object. Across the hop to a replica it becomes an
``EngineRequest`` (``engine_request``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from gateway.request.intake import Intake, take_in
from tandem_core.errors import invalid
from tandem_core.protocol import DEFAULT_TENANT, PRIORITY_ROUTES, EngineRequest


@dataclass(frozen=True)
class Claim:
    """Who asks for a slot, for admission (``gateway/admission/policy.py``): the request's priority
    (vLLM's field: lower is more urgent), its tenant and the tenant's weight."""

    priority: int = 0
    tenant: str = DEFAULT_TENANT
    weight: float = 1.0


NO_CLAIM = Claim()


TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context, continued by the engine's spans


@dataclass(slots=True)
class Envelope:
    route: str  # a route of ``tandem_core.protocol.ROUTE_TABLE``
    intake: Intake  # the body, read once; ``intake.body`` is what the engine gets
    request_id: str  # the gateway's id of the request (``x-request-id``; a batch line's custom_id-based one)
    request_id_from_client: bool = False  # the client chose it (two requests may carry the same one)
    key: object | None = None  # ``gateway.admission.keys.ResolvedKey`` (None: auth is off)
    claim: Claim = NO_CLAIM  # priority, tenant, weight (``claim_of``)
    queue_deadline_s: float | None = None  # the longest it may wait for a slot (the client's header)
    trace: dict[str, str] | None = None  # W3C trace context from the caller
    # What serving it measured, for its access line (``gateway.observability.logs``): queue_s, ttft_s, replica,
    # prompt_tokens, completion_tokens (the usage the client received)
    stats: dict = field(default_factory=dict)

    @property
    def body(self) -> dict:
        return self.intake.body

    @property
    def model(self) -> object:
        return self.intake.body.get("model")

    @property
    def timeout_at(self) -> float | None:
        return self.intake.timeout_at

    @property
    def key_name(self) -> str | None:
        return getattr(self.key, "name", None)

    def engine_request(self, request_id: str, trace: dict[str, str] | None = None) -> EngineRequest:
        """What crosses the hop (``request_id``: the engine's id of this attempt; ``trace``: the
        attempt's span context when tracing, else the caller's)."""
        deadline = None
        if self.intake.timeout_at is not None:  # loop time -> wall clock (the replica's clock)
            deadline = time.time() + (self.intake.timeout_at - asyncio.get_running_loop().time())
        return EngineRequest(self.route, self.intake.body, request_id, self.claim.priority,
                             getattr(self.key, "tenant_name", None), self.key_name, deadline, trace or self.trace)


def envelope(route: str, body: dict, *, request_id: str, config, key=None, request_id_from_client: bool = False,
             max_depth: int | None = None, headers: Mapping[str, str] | None = None,
             queue_deadline_s: float | None = None, timeout_s: float | None = None,
             priority: int | None = None) -> Envelope:
    """Build a request's record. ``max_depth``: the body's nesting limit (None: not checked:
    a body the gateway built); ``headers``: the session key's and the trace context's source;
    ``timeout_s``: the request timeout (None: ``limits.request_timeout_s``); ``priority``: the
    request's, whatever its body and key say (a batch line's class). Raises 400 for a body too
    deep or a bad ``priority``."""
    model = config.model(body.get("model"))
    affinity = model.session_affinity if model is not None else None
    if timeout_s is None:
        timeout_s = config.limits.request_timeout_s
    timeout_at = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
    intake = take_in(body, route, max_depth=max_depth, headers=headers,
                     session_header=affinity.header if affinity is not None and affinity.enabled else None,
                     timeout_at=timeout_at)
    trace = None
    if headers is not None and headers.get("traceparent"):
        trace = {h: headers[h] for h in TRACE_HEADERS if headers.get(h)}
    if priority is None:
        claim = claim_of(body, key, route)
    else:
        claim = Claim(priority, key.tenant_name, key.weight) if key is not None else Claim(priority)
        if route in PRIORITY_ROUTES:
            body["priority"] = priority
    return Envelope(route, intake, request_id, request_id_from_client, key, claim, queue_deadline_s, trace)


def claim_of(body: dict, api_key, route: str) -> Claim:
    """The request's priority (its body's vLLM ``priority``, else its key's default, raised to
    the key's ``min_priority``), tenant and weight. A generating request's body then carries the
    priority to the engine (vLLM's priority scheduling; the diffusion scheduler's order)."""
    asked = body.get("priority")
    if asked is not None and (not isinstance(asked, int) or isinstance(asked, bool)):
        raise invalid("priority: an integer (lower is more urgent)", "priority")
    if api_key is None:
        priority = asked or 0
        claim = Claim(priority) if priority else NO_CLAIM
    else:
        priority = api_key.priority if asked is None else asked
        if api_key.min_priority is not None and priority < api_key.min_priority:
            priority = api_key.min_priority  # raised, never refused
        claim = Claim(priority, api_key.tenant_name, api_key.weight)
    if priority != (asked or 0) and route in PRIORITY_ROUTES:
        body["priority"] = priority
    return claim
