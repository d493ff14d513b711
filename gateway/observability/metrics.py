"""Prometheus metrics: the gateway's own, and the engines' (collected from the replicas).

Labels come from bounded sets only: ``model`` (a configured name, else ``other``), ``route``
(a route template, else ``other``), ``status`` (a status class, ``2xx``...), ``replica`` (a
replica id), ``state`` and ``reason`` (enums). No user, key, prompt or raw path becomes a label.

Engine metrics reach Prometheus through the gateway: it polls every replica's ``stats()`` over
Ray (wherever the actor runs, any node) and exports the latest snapshot. One scrape target per
gateway, nothing to discover per node.

Several gateway processes on one host (``gateway/processes.py``): prometheus_client's
multiprocess mode (``use_multiprocess_dir``, before any metric exists): every process writes its
counters, histograms and gauges to files in one folder, and /metrics of any process (or the one
metrics port, served by the parent) sums them (gauges: ``livesum`` of the live processes; the
replica-state gauge: the latest write). Engine metrics are per replica, not per process: the
serving process exports its own latest snapshot of them.
"""

from __future__ import annotations

import json
import os
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tandem_core.errors import ErrorKind
from tandem_core.protocol import DEFAULT_TENANT, ROUTE_TABLE

# ``route`` labels: the route table's paths (``tandem_core.protocol.ROUTE_TABLE``), else "other";
# durations for its timed routes.
ROUTE_LABELS = tuple(r.path for r in ROUTE_TABLE)
TIMED_ROUTES = frozenset(r.path for r in ROUTE_TABLE if r.timed)
STATUS_CLASSES = ("2xx", "4xx", "5xx")
REJECT_REASONS = {
    ErrorKind.INVALID_REQUEST: "invalid", ErrorKind.CONTEXT_TOO_LONG: "context_too_long",
    ErrorKind.MODEL_NOT_FOUND: "unknown_model", ErrorKind.OVERLOADED: "overloaded",
    ErrorKind.NO_REPLICA: "no_replica", ErrorKind.QUEUE_TIMEOUT: "queue_timeout",
    ErrorKind.SHUTTING_DOWN: "shutting_down", ErrorKind.UNAUTHORIZED: "unauthorized",
    ErrorKind.RATE_LIMITED: "rate_limited", ErrorKind.REQUEST_TOO_LARGE: "too_large",
}
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
GAP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

# Engine stats -> exported metric: (name, kind, help). Counters are cumulative in the engine.
ENGINE_METRICS = {
    "running": ("tandem_engine_requests_running", "gauge", "Requests the engine holds (running)."),
    "waiting": ("tandem_engine_requests_waiting", "gauge", "Requests waiting inside the engine."),
    "kv_cache_usage": ("tandem_engine_kv_cache_usage_ratio", "gauge", "vLLM KV-cache usage (0-1)."),
    "prefix_cache_queries": ("tandem_engine_prefix_cache_queries", "counter",
                             "Prefix-cache queried prompt tokens (vLLM's, or the diffusion fast sampler's)."),
    "prefix_cache_hits": ("tandem_engine_prefix_cache_hits", "counter",
                          "Prefix-cache hit prompt tokens (vLLM's, or the diffusion fast sampler's)."),
    "prompt_tokens": ("tandem_engine_prompt_tokens", "counter", "Prompt tokens the engine processed."),
    "generation_tokens": ("tandem_engine_generation_tokens", "counter", "Tokens the engine generated."),
    "active_batch": ("tandem_diffusion_active_batch", "gauge", "Sequences in the diffusion batch."),
    "kv_cached_pages": ("tandem_diffusion_kv_cached_pages", "gauge",
                        "KV pages (all layers) kept for prefix reuse that no sequence holds (reclaimable)."),
    "canvas_occupancy": ("tandem_diffusion_canvas_occupancy_ratio", "gauge", "Active sequences / max_batch."),
    "admitted": ("tandem_diffusion_admitted", "counter", "Sequences admitted into the batch."),
    "admission_wait_sum_s": ("tandem_diffusion_admission_wait_seconds", "counter",
                             "Total seconds sequences waited to be admitted (divide by admitted)."),
    "steps": ("tandem_diffusion_decoder_forwards", "counter", "Batched decoder forwards (denoise steps)."),
    "row_steps": ("tandem_diffusion_row_steps", "counter", "Sequence-steps denoised (rows x forwards)."),
    "row_steps_waiting": ("tandem_diffusion_row_steps_waiting", "counter",
                          "Converged rows idle until their block boundary (block mode)."),
    "blocks_committed": ("tandem_diffusion_blocks_committed", "counter", "Blocks committed."),
    "block_seconds": ("tandem_diffusion_block_seconds", "counter", "Total block latency (divide by blocks)."),
    "tokens_committed": ("tandem_diffusion_tokens_committed", "counter", "Tokens committed."),
    "aborted": ("tandem_diffusion_cancelled", "counter", "Sequences cancelled (client gone, stop)."),
    "forward_s": ("tandem_diffusion_forward_seconds", "counter", "Seconds inside model forwards."),
    "busy_s": ("tandem_diffusion_busy_seconds", "counter", "Seconds inside batcher steps."),
    "errors": ("tandem_diffusion_failed_batches", "counter", "Batched steps that failed."),
    "images": ("tandem_diffusion_images", "counter", "Images received (divide by image_requests: per request)."),
    "image_requests": ("tandem_diffusion_image_requests", "counter", "Requests that carried images."),
    "image_encode_s": ("tandem_diffusion_image_encode_seconds", "counter",
                       "Seconds decoding images and running the vision tower (off the denoise loop)."),
}


MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def use_multiprocess_dir(path: str) -> None:
    """Metrics created from now on, in this process and in processes started from it (they
    inherit the environment), live in files under ``path`` and /metrics sums them."""
    from prometheus_client import values

    os.environ[MULTIPROC_ENV] = path
    values.ValueClass = values.MultiProcessValue()  # prometheus_client chose at import


def multiprocess_dir() -> str | None:
    return os.environ.get(MULTIPROC_ENV) or None


def mark_process_dead(pid: int) -> None:
    """A gateway process exited: its live gauges stop counting."""
    path = multiprocess_dir()
    if path:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, path)


ANONYMOUS = DEFAULT_TENANT  # the tenant of requests when auth is off (admission's too)
PRIORITY_CLASSES = ("urgent", "default", "bulk", "batch")
BATCH_PRIORITY = 1000  # ``batches.priority``'s default: lines of the Batch API


def priority_class(priority: int, batch_priority: int = BATCH_PRIORITY) -> str:
    """A bounded label for vLLM's unbounded integer priority (``batch``: the Batch API's lines)."""
    if priority >= batch_priority:
        return "batch"
    return "urgent" if priority < 0 else "default" if priority == 0 else "bulk"

USAGE = (("requests", "requests"), ("prompt_tokens", "prompt tokens"), ("generation_tokens", "generated tokens"))


class Metrics:
    def __init__(self, models: list[str], tenants: dict[str, str] | None = None,
                 batch_priority: int = BATCH_PRIORITY):
        self.batch_priority = batch_priority
        """``tenants``: each API key's name -> its tenant (none: auth is off, one tenant)."""
        self.models = set(models)
        self.tenant_of = dict(tenants or {})
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("tandem_requests", "HTTP requests by model, route and status class.",
                                ["model", "route", "status"], registry=r)
        self.duration = Histogram("tandem_request_duration_seconds", "Request duration, to the last byte.",
                                  ["model", "route"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("tandem_time_to_first_token_seconds", "Streaming: time to the first chunk.",
                              ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.chunk_gap = Histogram("tandem_time_between_chunks_seconds", "Streaming: time between chunks.",
                                   ["model"], buckets=GAP_BUCKETS, registry=r)
        self.prompt_tokens = Counter("tandem_prompt_tokens", "Prompt tokens reported in responses' usage.",
                                     ["model"], registry=r)
        self.output_tokens = Counter("tandem_output_tokens", "Completion tokens reported in responses' usage.",
                                     ["model"], registry=r)
        self.in_flight = Gauge("tandem_requests_in_flight", "Generation requests being served.", ["model"], registry=r,
                               multiprocess_mode="livesum")
        self.queued = Gauge("tandem_requests_queued", "Generation requests waiting in the gateway.", ["model"],
                            registry=r, multiprocess_mode="livesum")
        self.queue_wait = Histogram("tandem_queue_wait_seconds", "Time from arrival to a replica slot (requests "
                                    "that got one).", ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.rejected = Counter("tandem_requests_rejected", "Requests refused before reaching an engine.",
                                ["model", "reason"], registry=r)
        self.replicas = Gauge("tandem_replicas", "Replicas by state.", ["model", "state"], registry=r,
                              multiprocess_mode="livemostrecent")
        self.replicas_desired = Gauge("tandem_replicas_desired", "Replicas asked for (autoscaling's decision; "
                                      "else the configured count).", ["model"], registry=r,
                                      multiprocess_mode="livemostrecent")
        self.replicas_running = Gauge("tandem_replicas_running", "Replicas serving (healthy).", ["model"],
                                      registry=r, multiprocess_mode="livemostrecent")
        self.replicas_pending = Gauge("tandem_replicas_pending", "Replicas created and not serving yet (starting, "
                                      "or waiting for a node that can hold them).", ["model"], registry=r,
                                      multiprocess_mode="livemostrecent")
        self.scale_events = Counter("tandem_scale_events", "Autoscaling decisions, by direction (up: replicas "
                                    "added, down: one drained and removed).", ["model", "direction"], registry=r)
        self.restarts = Counter("tandem_replica_restarts", "Replicas restarted (died, stuck or failing).", ["model"],
                                registry=r)
        self.retries = Counter("tandem_request_retries",
                               "Requests retried on another replica (their replica failed before the first byte).",
                               ["model"], registry=r)
        for m in [*self.models, "other"]:  # every series exists from the start (at 0)
            for route in (*ROUTE_LABELS, "other"):
                for status in STATUS_CLASSES:
                    self.requests.labels(m, route, status)
            for route in TIMED_ROUTES:
                self.duration.labels(m, route)
            for child in (self.ttft, self.chunk_gap, self.prompt_tokens, self.output_tokens, self.in_flight,
                          self.queued, self.restarts, self.retries, self.queue_wait):
                child.labels(m)
            for reason in set(REJECT_REASONS.values()):
                self.rejected.labels(m, reason)
            for direction in ("up", "down"):
                self.scale_events.labels(m, direction)
        # Usage per tenant and per key, as the clients' `usage` said (labels bounded by the config's keys).
        self.tenant_usage = {what: Counter(f"tandem_tenant_{what}", f"{text.capitalize()} per tenant (the `usage` "
                                           "clients received).", ["tenant", "model"], registry=r)
                             for what, text in USAGE}
        self.key_usage = {what: Counter(f"tandem_key_{what}", f"{text.capitalize()} per API key.", ["key", "model"],
                                        registry=r) for what, text in USAGE}
        self.admitted_wait = Histogram("tandem_admission_wait_seconds", "Time from arrival to a replica slot, by "
                                       "priority class (urgent < 0, default 0, bulk > 0, batch: batches.priority "
                                       "and beyond).", ["model", "priority_class"],
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.queued_by_class = Gauge("tandem_admission_queued", "Requests waiting in the gateway, by priority class.",
                                     ["model", "priority_class"], registry=r, multiprocess_mode="livesum")
        # Batches (OpenAI's Batch API): the store's counts, read by each gateway process's runner.
        self.batches = Gauge("tandem_batches", "Batches by status (from the batch store).", ["status"], registry=r,
                             multiprocess_mode="livemostrecent")
        self.batch_lines = Counter("tandem_batch_lines", "Batch lines answered, by outcome (completed: status 200; "
                                   "failed: an error line).", ["outcome"], registry=r)
        self.batch_queue_age = Gauge("tandem_batch_queue_age_seconds", "Age of the oldest batch not yet finished "
                                     "(0: none).", registry=r, multiprocess_mode="livemostrecent")
        for outcome in ("completed", "failed"):
            self.batch_lines.labels(outcome)
        self._engines = _EngineCollector()
        r.register(self._engines)
        self.exposition = r  # what /metrics shows
        path = multiprocess_dir()
        if path:  # every gateway process's metrics, summed, and this one's engine snapshot
            from prometheus_client import multiprocess

            self.exposition = CollectorRegistry(auto_describe=True)
            multiprocess.MultiProcessCollector(self.exposition, path=path)
            self.exposition.register(self._engines)

    def add_model(self, name: str) -> None:
        """A model label from now on (a LoRA adapter loaded at run time; their number is bounded)."""
        self.models.add(name)

    def model_label(self, model: object) -> str:
        return model if isinstance(model, str) and model in self.models else "other"

    @staticmethod
    def route_label(scope: dict) -> str:
        """The ``route`` label of a request: the template of the route it matched, if the table has it."""
        path = getattr(scope.get("route"), "path", None)
        return path if path in ROUTE_LABELS else "other"

    def observe_request(self, model: str, route: str, status: int, seconds: float) -> None:
        self.requests.labels(model, route, f"{status // 100}xx" if 200 <= status < 600 else "5xx").inc()
        if route in TIMED_ROUTES:
            self.duration.labels(model, route).observe(seconds)

    def observe_rejected(self, model: str, kind: ErrorKind) -> None:
        reason = REJECT_REASONS.get(kind)
        if reason is not None:
            self.rejected.labels(model, reason).inc()

    def observe_usage(self, model: str, usage: dict | None, key: str | None = None) -> None:
        """``usage`` as a client received it (``key``: its API key's name; None: auth is off)."""
        if usage:
            prompt = usage.get("prompt_tokens") or usage.get("input_tokens") or 0
            generated = usage.get("completion_tokens") or usage.get("output_tokens") or 0
            self.prompt_tokens.labels(model).inc(prompt)
            self.output_tokens.labels(model).inc(generated)
            self._count(key, model, "prompt_tokens", prompt)
            self._count(key, model, "generation_tokens", generated)

    def set_queued_by_class(self, model: str, by_priority: dict[int, int]) -> None:
        counts = dict.fromkeys(PRIORITY_CLASSES, 0)
        for priority, n in by_priority.items():
            counts[priority_class(priority, self.batch_priority)] += n
        for cls, n in counts.items():
            self.queued_by_class.labels(model, cls).set(n)

    def observe_admitted(self, model: str, priority: int, waited_s: float) -> None:
        self.admitted_wait.labels(model, priority_class(priority, self.batch_priority)).observe(waited_s)

    def set_batches(self, by_status: dict[str, int], oldest_active: float | None) -> None:
        """``by_status``: every batch status, with 0 where no batch has it (the runner's)."""
        for status, n in by_status.items():
            self.batches.labels(status).set(n)
        self.batch_queue_age.set(max(0.0, time.time() - oldest_active) if oldest_active is not None else 0.0)

    def observe_batch_line(self, outcome: str) -> None:
        self.batch_lines.labels(outcome).inc()

    def observe_served(self, model: str, key: str | None) -> None:
        """A request to ``model`` answered (whatever its status), counted to its key and tenant."""
        self._count(key, model, "requests", 1)

    def _count(self, key: str | None, model: str, what: str, n: float) -> None:
        if not n:
            return
        tenant = self.tenant_of.get(key, "other") if key is not None else ANONYMOUS
        self.tenant_usage[what].labels(tenant, model).inc(n)
        if key is not None:
            self.key_usage[what].labels(key if key in self.tenant_of else "other", model).inc(n)

    def usage(self) -> dict:
        """/admin/usage: every gateway process's counts (the multiprocess registry's sums)."""
        out: dict[str, dict] = {"tenants": {}, "keys": {}}
        names = {f"tandem_tenant_{w}_total": ("tenants", w) for w, _ in USAGE}
        names.update({f"tandem_key_{w}_total": ("keys", w) for w, _ in USAGE})
        for family in self.exposition.collect():
            for sample in family.samples:
                where = names.get(sample.name)
                if where is None or not sample.value:
                    continue
                who = sample.labels.get("tenant") or sample.labels.get("key")
                row = out[where[0]].setdefault(who, {}).setdefault(sample.labels["model"], {w: 0 for w, _ in USAGE})
                row[where[1]] += int(sample.value)
        return out

    def observe_sse(self, model: str, chunk: str, key: str | None = None) -> dict | None:
        """Usage is reported in the stream's last data events, when the client asked for it.
        Returns the usage counted (None: none in this chunk)."""
        if '"usage"' not in chunk:
            return None
        found = None
        for line in chunk.split("\n"):
            if line.startswith("data: {") and '"usage"' in line:
                try:
                    event = json.loads(line[6:])
                except ValueError:
                    continue
                # Responses' stream: the usage is the completed response's
                usage = event.get("usage") or (event.get("response") or {}).get("usage")
                self.observe_usage(model, usage, key)
                found = usage or found
        return found

    def set_replicas(self, rows: list[tuple[str, str, str, dict | None]], states: list[str]) -> None:
        """rows: (model, replica id, state, engine stats or None)."""
        for m in self.models:
            for s in states:
                self.replicas.labels(m, s).set(sum(1 for r in rows if r[0] == m and r[2] == s))
        self._engines.rows = rows


    def queued_everywhere(self, model: str) -> float:
        """Requests of ``model`` queued in every gateway process on this host (the shared
        multiprocess files; a single process: its own gauge)."""
        if self.exposition is self.registry:
            return self.queued.labels(model)._value.get()
        return sum(s.value for family in self.exposition.collect() if family.name == "tandem_requests_queued"
                   for s in family.samples if s.labels.get("model") == model)

    def set_scaling(self, model: str, counts: dict[str, int]) -> None:
        """counts: ``views.replica_counts`` of one model."""
        self.replicas_desired.labels(model).set(counts["desired"])
        self.replicas_running.labels(model).set(counts["running"])
        self.replicas_pending.labels(model).set(counts["pending"])


class _EngineCollector:
    """Exports the latest engine snapshot of every replica (polled by the service)."""

    def __init__(self):
        self.rows: list[tuple[str, str, str, dict | None]] = []

    def describe(self):
        return []

    def collect(self):
        families = {}
        for key, (name, kind, doc) in ENGINE_METRICS.items():
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            families[key] = cls(name, doc, labels=["model", "replica"])
        for model, replica, _, stats in self.rows:
            for key, value in (stats or {}).items():
                if key in families and isinstance(value, (int, float)):
                    families[key].add_metric([model, replica], float(value))
        yield from families.values()
        yield from engine_families(self.rows)


def engine_families(rows) -> list[Metric]:
    """Each replica's own engine families (vLLM's ``vllm:*``, as `vllm serve` exports them: the
    replica sends their text with its stats) under their own names and labels, plus ``replica``:
    one family per name over every replica, so vLLM's dashboards and rules read them unchanged."""
    merged: dict[str, Metric] = {}
    for _model, replica, _, stats in rows:
        text = (stats or {}).get("exposition")
        if not text:
            continue
        for family in text_string_to_metric_families(text):
            out = merged.get(family.name)
            if out is None:
                out = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                out.samples.append(Sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar))
    return list(merged.values())


def now() -> float:
    return time.perf_counter()

