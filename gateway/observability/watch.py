"""What one request's serving reports as it goes: queued, admitted on a replica, each attempt,
the first item, the end. ``serve`` (``gateway/serving/serve.py``) calls a ``RequestWatch`` at each
of these moments and knows nothing of what is recorded: the metrics always, the spans of
``gateway/observability/tracing.py`` when tracing is on (``tracing`` None: no span object is
built), and the request's access-line stats (``env.stats``).
"""

from __future__ import annotations

import re
import time

_ID = re.compile(r'"id": ?"([^"]+)"')


class RequestWatch:
    def __init__(self, metrics, tracing, env, model: str, kind: str, internal: bool = False):
        """``model``: the metrics' label of the request's model; ``kind``: its ``ModelKind`` value
        (the span's provider); ``internal``: not a client's request (a batch line)."""
        self.metrics, self.tracing, self.env, self.model = metrics, tracing, env, model
        self.t0 = self._waited = time.perf_counter()
        self.span = self._queued = self._attempt = None
        if tracing is not None:
            self.span = tracing.request_span(env, kind, internal)
            context = self.span.get_span_context()
            if context.trace_flags.sampled:  # the access line names its trace
                env.stats["trace_id"] = format(context.trace_id, "032x")

    # -- the moments, in order ------------------------------------------------------------------
    def queued(self) -> None:
        """It asks for a slot (again, on a retry)."""
        self._waited = time.perf_counter()
        if self.span is not None:
            claim = self.env.claim
            self._queued = self.tracing.start_child(self.span, "admission", **{"tandem.priority": claim.priority,
                                                                              "tandem.tenant": claim.tenant})

    def admitted(self, replica) -> None:
        """It holds a slot on ``replica`` (until ``released``)."""
        waited = time.perf_counter() - self._waited
        if self._queued is not None:
            self._queued.set_attribute("tandem.queue_time_s", waited)
            self._queued.end()
            self._queued = None
        self.env.stats["queue_s"] = waited
        self.env.stats["replica"] = replica.id
        self.metrics.queue_wait.labels(self.model).observe(waited)
        self.metrics.observe_admitted(self.model, self.env.claim.priority, waited)
        self.metrics.in_flight.labels(self.model).inc()

    def not_admitted(self) -> None:
        """Its wait for a slot ended without one (refused, timed out, cancelled)."""
        if self._queued is not None:
            self._queued.set_attribute("tandem.queue_time_s", time.perf_counter() - self._waited)
            self._queued.end()
            self._queued = None

    def attempt(self, replica, engine_request_id: str) -> dict[str, str] | None:
        """A try on ``replica``: its W3C context for the engine's spans (None: not traced)."""
        if self.span is None:
            return None
        self._attempt = self.tracing.start_child(self.span, "attempt", **{
            "tandem.replica.id": replica.id, "tandem.replica.generation": replica.generation,
            "tandem.engine_request_id": engine_request_id})
        return self.tracing.context_of(self._attempt)

    def attempt_ended(self, error=None) -> None:
        """The try ended (``error``: the failure that ended it)."""
        attempt, self._attempt = self._attempt, None
        if attempt is None:
            return
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            attempt.set_attribute("error.type", error.kind.value)
            attempt.set_status(Status(StatusCode.ERROR, error.message))
        attempt.end()

    def retried(self, error) -> None:
        """The try failed before its first byte and the request goes to another replica."""
        self.metrics.retries.labels(self.model).inc()
        self.attempt_ended(error)

    def released(self) -> None:
        """Its slot is given back (once)."""
        self.metrics.in_flight.labels(self.model).dec()

    def first(self, stream: bool) -> None:
        """Its first item arrived: a stream's first chunk, or the whole answer."""
        self.env.stats["ttft_s"] = time.perf_counter() - self.t0
        if stream:
            self.metrics.ttft.labels(self.model).observe(self.env.stats["ttft_s"])

    # -- the end --------------------------------------------------------------------------------
    def answered(self, answer: dict) -> None:
        """A JSON answer: what the client receives, counted to the model, its key and tenant."""
        self.metrics.observe_usage(self.model, answer.get("usage"), self.env.key_name)
        note_usage(self.env.stats, answer.get("usage"))
        if self.span is not None:
            self.tracing.finish(self.span, answer, self.env.stats)

    def failed(self, error: BaseException) -> None:
        self.attempt_ended()
        if self.span is not None:
            self.tracing.finish(self.span, stats=self.env.stats, error=error)

    def streaming(self, first: str) -> None:
        """A stream began with ``first``: its span's response id is the first chunk's."""
        if self.span is not None:
            found = _ID.search(first or "")
            if found:
                self.span.set_attribute("gen_ai.response.id", found.group(1))

    def stream_ended(self) -> None:
        self.attempt_ended()  # a stream's attempt lasts as long as it does
        if self.span is not None:
            self.tracing.finish(self.span, stats=self.env.stats)


def note_usage(stats: dict, usage: object) -> None:
    """The usage the client received, for its access line."""
    if isinstance(usage, dict):
        stats["prompt_tokens"] = usage.get("prompt_tokens", usage.get("input_tokens"))
        stats["completion_tokens"] = usage.get("completion_tokens", usage.get("output_tokens"))
