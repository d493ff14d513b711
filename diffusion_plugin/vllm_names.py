"""vLLM's metric families that mean the same on a diffusion replica, under vLLM's names and labels
(``model_name``, ``engine``), so one dashboard (vLLM's own, or a KEDA rule on
``vllm:num_requests_waiting``) covers both kinds; the gateway re-exports them with a ``replica``
label as it does a vLLM replica's (``gateway.metrics.engine_families``)."""

from __future__ import annotations

VLLM_FAMILIES = (
    ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", "running"),
    ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", "waiting"),
    ("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.", "prompt"),
    ("vllm:generation_tokens", "counter", "Number of generation tokens processed.", "generation"),
    ("vllm:prefix_cache_queries", "counter", "Prefix cache queries, in terms of number of queried tokens.",
     "prefix_cache_queries"),
    ("vllm:prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens.",
     "prefix_cache_hits"),
)


def vllm_exposition(model: str, running: int, waiting: int, prompt: int, generation: int, prefix: dict) -> str:
    """The Prometheus text of ``VLLM_FAMILIES`` (labels ``model_name`` and ``engine``, as vLLM's)."""
    values = {"running": running, "waiting": waiting, "prompt": prompt, "generation": generation, **prefix}
    lines = []
    for name, kind, doc, key in VLLM_FAMILIES:
        if key not in values:
            continue  # (no prefix cache: no prefix families, as vLLM without one)
        sample = f"{name}_total" if kind == "counter" else name
        lines += [f"# HELP {sample} {doc}", f"# TYPE {sample} {kind}",
                  f'{sample}{{engine="0",model_name="{model}"}} {float(values[key])}']
    return "\n".join(lines) + "\n"

