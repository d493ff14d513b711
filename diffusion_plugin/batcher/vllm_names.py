"""vLLM's metric families that mean the same on a diffusion replica, under vLLM's names and labels
(``model_name``, ``engine``), so one dashboard (vLLM's own, or a KEDA rule on
``vllm:num_requests_waiting``) covers both kinds; the gateway re-exports them with a ``replica``
label as it does a vLLM replica's (``gateway.observability.metrics.engine_families``)."""

from __future__ import annotations

import bisect
from collections import Counter

from diffusion_plugin.batcher.request import SeqStatus, Sequence

VLLM_FAMILIES = (
    ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", "running"),
    ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", "waiting"),
    ("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.", "prompt"),
    ("vllm:generation_tokens", "counter", "Number of generation tokens processed.", "generation"),
    ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", "kv_cache_usage"),
    ("vllm:prefix_cache_queries", "counter", "Prefix cache queries, in terms of number of queried tokens.",
     "prefix_cache_queries"),
    ("vllm:prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens.",
     "prefix_cache_hits"),
)


def vllm_exposition(model: str, running: int, waiting: int, prompt: int, generation: int, prefix: dict,
                    kv_cache_usage: float) -> str:
    """The Prometheus text of ``VLLM_FAMILIES`` (labels ``model_name`` and ``engine``, as vLLM's).
    ``kv_cache_usage``: the share of the replica's memory budget its admitted sequences reserve."""
    values = {"running": running, "waiting": waiting, "prompt": prompt, "generation": generation,
              "kv_cache_usage": kv_cache_usage, **prefix}
    lines = []
    for name, kind, doc, key in VLLM_FAMILIES:
        if key not in values:
            continue  # (no prefix cache: no prefix families, as vLLM without one)
        sample = f"{name}_total" if kind == "counter" else name
        lines += [f"# HELP {sample} {doc}", f"# TYPE {sample} {kind}",
                  f'{sample}{{engine="0",model_name="{model}"}} {float(values[key])}']
    return "\n".join(lines) + "\n"



# vLLM's finished_reason label of each way a sequence ends (vllm.v1.engine.FinishReason's strings)
_REASONS = {SeqStatus.FINISHED_STOPPED: "stop", SeqStatus.FINISHED_LENGTH: "length",
            SeqStatus.FINISHED_ABORTED: "abort", SeqStatus.FINISHED_ERROR: "error"}
# (family, vLLM's bucket family, documentation): observed once per sequence that ended with
# ``stop`` or ``length`` (as vLLM observes its finished requests; a choice of n is one sequence)
_HISTOGRAMS = (
    ("vllm:time_to_first_token_seconds", "time_to_first_token", "Histogram of time to first token in seconds."),
    ("vllm:e2e_request_latency_seconds", "request_latency", "Histogram of e2e request latency in seconds."),
    ("vllm:request_queue_time_seconds", "request_latency",
     "Histogram of time spent in WAITING phase for request."),
    ("vllm:request_inference_time_seconds", "request_latency",
     "Histogram of time spent in RUNNING phase for request."),
    ("vllm:request_prefill_time_seconds", "request_latency",
     "Histogram of time spent in PREFILL phase for request."),
    ("vllm:request_decode_time_seconds", "request_latency", "Histogram of time spent in DECODE phase for request."),
    ("vllm:request_prompt_tokens", "request_tokens", "Number of prefill tokens processed."),
    ("vllm:request_generation_tokens", "request_tokens", "Number of generation tokens processed."),
    ("vllm:request_max_num_generation_tokens", "request_tokens",
     "Histogram of maximum number of requested generation tokens."),
    ("vllm:request_params_max_tokens", "request_tokens", "Histogram of the max_tokens request parameter."),
)


UNBOUNDED_LEN = 1 << 20  # the token histograms' top bucket for a model without a context limit


class RequestHistograms:
    """vLLM's per-request families on a diffusion replica, with vLLM's own bucket bounds
    (``vllm.v1.metrics.buckets``): queue (arrival to admission), prefill (admission to the first
    committed block), decode (first block to the end), time to first token (arrival to the first
    committed block: a block, not a token, is the unit a diffusion model streams), end to end;
    token counts; ``vllm:request_success_total`` by ``finished_reason``. Owned by the loop, which
    stamps the times; read by the engine's stats."""

    def __init__(self, max_model_len: int | None):
        """``max_model_len``: the model's context (the token histograms' top bucket); None (a
        family without a position limit): ``UNBOUNDED_LEN``."""
        from vllm.v1.metrics.buckets import histogram_buckets  # (~2 s: imported once, at start)

        top = max_model_len or UNBOUNDED_LEN
        self.bounds = {name: histogram_buckets(fam, max_model_len=top) for name, fam, _ in _HISTOGRAMS}
        self.buckets = {name: [0] * (len(b) + 1) for name, b in self.bounds.items()}  # the last: +Inf
        self.sums: Counter = Counter()
        self.success: Counter = Counter()

    def finished(self, seq: Sequence, now: float) -> None:
        reason = _REASONS.get(seq.status)
        if reason is None:
            return
        self.success[reason] += 1
        if reason not in ("stop", "length") or seq.admitted_at is None:
            return
        first = seq.first_token_at
        if first is not None:
            self._observe("vllm:time_to_first_token_seconds", first - seq.arrival)
        self._observe("vllm:e2e_request_latency_seconds", now - seq.arrival)
        self._observe("vllm:request_queue_time_seconds", seq.admitted_at - seq.arrival)
        self._observe("vllm:request_inference_time_seconds", now - seq.admitted_at)
        self._observe("vllm:request_prefill_time_seconds", (first or now) - seq.admitted_at)
        self._observe("vllm:request_decode_time_seconds", now - first if first is not None else 0.0)
        self._observe("vllm:request_prompt_tokens", seq.prompt_len)
        self._observe("vllm:request_generation_tokens", len(seq.output_ids))
        self._observe("vllm:request_max_num_generation_tokens", len(seq.output_ids))
        self._observe("vllm:request_params_max_tokens", seq.params.max_tokens)

    def _observe(self, name: str, value: float) -> None:
        self.buckets[name][bisect.bisect_left(self.bounds[name], value)] += 1
        self.sums[name] += value

    def exposition(self, model: str) -> str:
        """Prometheus text, labels as vLLM's (``model_name``, ``engine``)."""
        labels = f'engine="0",model_name="{model}"'
        lines = ["# HELP vllm:request_success_total Count of successfully processed requests.",
                 "# TYPE vllm:request_success_total counter"]
        lines += [f'vllm:request_success_total{{{labels},finished_reason="{r}"}} {float(self.success[r])}'
                  for r in _REASONS.values()]
        for name, _, doc in _HISTOGRAMS:
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} histogram"]
            total = 0
            for bound, count in zip([*self.bounds[name], "+Inf"], self.buckets[name], strict=True):
                total += count
                lines.append(f'{name}_bucket{{{labels},le="{float(bound) if bound != "+Inf" else bound}"}} {total:.1f}')
            lines += [f"{name}_count{{{labels}}} {total:.1f}", f"{name}_sum{{{labels}}} {self.sums[name]}"]
        return "\n".join(lines) + "\n"
