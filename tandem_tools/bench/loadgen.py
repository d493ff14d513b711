"""A small httpx load generator for streaming chat (the openai SDK client itself costs ~25%
of throughput at 32 streams on 2 cores, so benchmarks do not use it)."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float = 0.0
    latency_s: float = 0.0
    output_tokens: int = 0
    gaps_s: list[float] = field(default_factory=list)  # between content events
    error: str | None = None


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    errors: int
    wall_s: float
    output_tokens: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    latency_p50_ms: float
    latency_p99_ms: float = float("nan")

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.wall_s if self.wall_s else 0.0

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0

    def as_dict(self) -> dict:
        return {**self.__dict__, "requests_per_s": self.requests_per_s, "output_tokens_per_s": self.output_tokens_per_s}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


async def one_stream(client: httpx.AsyncClient, url: str, body: dict) -> RequestResult:
    t0 = time.perf_counter()
    first = last = None
    gaps: list[float] = []
    tokens = 0
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                return RequestResult(ok=False, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return RequestResult(ok=False, error=str(event["error"])[:200])
                now = time.perf_counter()
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                choices = event.get("choices") or []
                if choices and (choices[0].get("delta", {}).get("content") or choices[0].get("text")):
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
    except httpx.HTTPError as e:
        return RequestResult(ok=False, error=f"{type(e).__name__}: {e}")
    end = time.perf_counter()
    return RequestResult(ok=True, ttft_s=(first or end) - t0, latency_s=end - t0, output_tokens=tokens, gaps_s=gaps)


async def run_level(base_url: str, bodies: list[dict], concurrency: int, timeout_s: float = 600) -> LevelResult:
    """Send every body (streaming chat) with at most ``concurrency`` in flight."""
    url = base_url.rstrip("/") + "/v1/chat/completions"
    queue: asyncio.Queue = asyncio.Queue()
    for b in bodies:
        queue.put_nowait(b)
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        async def worker() -> None:
            while not queue.empty():
                results.append(await one_stream(client, url, queue.get_nowait()))

        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(concurrency))), timeout_s)
        wall = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    ms = 1000.0
    return LevelResult(
        concurrency=concurrency,
        requests=len(ok),
        errors=len(results) - len(ok),
        wall_s=wall,
        output_tokens=sum(r.output_tokens for r in ok),
        ttft_p50_ms=percentile([r.ttft_s for r in ok], 0.5) * ms,
        ttft_p99_ms=percentile([r.ttft_s for r in ok], 0.99) * ms,
        itl_p50_ms=percentile([g for r in ok for g in r.gaps_s], 0.5) * ms,
        latency_p50_ms=statistics.median([r.latency_s for r in ok]) * ms if ok else float("nan"),
        latency_p99_ms=percentile([r.latency_s for r in ok], 0.99) * ms,
    )
