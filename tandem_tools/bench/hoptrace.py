"""Where a streaming request's first token spends its time: a timestamp at every hop, in every
process (the gateway, the replica actor, `vllm serve`), for sequential requests (c=1).

``python -m tandem_tools.bench.hoptrace [--targets direct,tandem] [--requests 40]`` starts each server
with a ``sitecustomize`` on its PYTHONPATH that, in every Python process it starts (Ray's workers
inherit the environment), wraps a few functions as their modules load and appends
``monotonic_ns event pid`` lines to one file (CLOCK_MONOTONIC is one clock for all processes of
a host). Requests are sequential, so an event belongs to the request whose client window holds
it; no id needs to cross a process. It prints the median time from the client's send to each
hop's first occurrence, and the gap to the hop before. A diagnostic: nothing imports it.
"""

from __future__ import annotations

import argparse
import functools
import importlib.abc
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ENV = "TANDEM_HOPTRACE_FILE"
# The hops in request order: (event, what the gap before it is).
HOPS = [
    ("g_asgi_in", "HTTP in (client send -> gateway ASGI app)"),
    ("g_body", "body intake (read + JSON)"),
    ("g_acquired", "checks + routing/acquire"),
    ("g_submit_call", "to the call into the replica"),
    ("a_submit_in", "submit: gateway -> actor (socket or Ray call)"),
    ("v_chat_in", "actor -> vLLM serving layer"),
    ("v_chat_ret", "vLLM serving: chat template, tokenize, request built"),
    ("v_add_in", "to AsyncLLM.add_request (its stream starts)"),
    ("v_add_out", "add_request: input processing, sent to the engine core"),
    ("v_output", "engine core: prefill, first token, output processing"),
    ("v_chunk", "vLLM serving: first SSE chunk"),
    ("a_put", "into the channel outbox"),
    ("a_yield", "outbox -> the channel (a frame or a Ray stream item)"),
    ("g_feed", "the channel: actor -> gateway (Demux)"),
    ("g_first_item", "Demux queue -> request handler"),
    ("g_send_body", "StreamingResponse: first body message"),
    ("c_first", "SSE out (-> client's first event)"),
]
_fd: int | None = None


def rec(event: str) -> None:
    os.write(_fd, f"{time.monotonic_ns()} {event} {os.getpid()}\n".encode())


# -- wrappers -----------------------------------------------------------------------------------
def _around(fn, before: str | None, after: str | None):
    @functools.wraps(fn)
    async def wrapper(*a, **k):
        if before:
            rec(before)
        try:
            return await fn(*a, **k)
        finally:
            if after:
                rec(after)
    return wrapper


def _each_yield(fn, event: str):
    @functools.wraps(fn)
    async def wrapper(*a, **k):
        async for x in fn(*a, **k):
            rec(event)
            yield x
    return wrapper


def _patch_gateway_app(m) -> None:
    orig = m.MetricsMiddleware.__call__

    async def call(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await orig(self, scope, receive, send)
        rec("g_asgi_in")

        async def timed_send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                rec("g_send_body")
            await send(message)
        return await orig(self, scope, receive, timed_send)
    m.MetricsMiddleware.__call__ = call


def _patch_generate(m) -> None:
    for name in ("envelope_of", "take_in_request", "_read_json"):  # the body's intake (its name changed)
        if hasattr(m, name):
            setattr(m, name, _around(getattr(m, name), None, "g_body"))
            break


def _patch_serve(m) -> None:
    m._acquire = _around(m._acquire, None, "g_acquired")


def _patch_streaming(m) -> None:
    m.until_disconnect = _around(m.until_disconnect, None, "g_first_item")


def _patch_handles(m) -> None:
    m.ChannelReplicaHandle._submit = _around(m.ChannelReplicaHandle._submit, "g_submit_call", "g_submit_ack")


def _patch_channel(m) -> None:
    feed, put = m.Demux.feed, m.Outbox.put

    def timed_feed(self, batch):
        rec("g_feed")
        return feed(self, batch)

    def timed_put(self, request_id, item):
        if item is not None:
            rec("a_put")
        return put(self, request_id, item)
    m.Demux.feed, m.Outbox.put = timed_feed, timed_put
    m.Outbox.stream = _each_yield(m.Outbox.stream, "a_yield")


def _patch_actor(m) -> None:
    orig = m.EngineActor.submit_on  # both channels' submits end here

    def submit_on(*a, **k):
        rec("a_submit_in")
        return orig(*a, **k)
    m.EngineActor.submit_on = submit_on


def _patch_vllm_chat(m) -> None:
    cls = m.OpenAIServingChat
    cls.create_chat_completion = _around(cls.create_chat_completion, "v_chat_in", "v_chat_ret")
    cls.chat_completion_stream_generator = _each_yield(cls.chat_completion_stream_generator, "v_chunk")


def _patch_async_llm(m) -> None:
    m.AsyncLLM.add_request = _around(m.AsyncLLM.add_request, "v_add_in", "v_add_out")
    m.AsyncLLM.generate = _each_yield(m.AsyncLLM.generate, "v_output")


PATCHES = {
    "gateway.http.app": _patch_gateway_app,
    "gateway.http.generate": _patch_generate,
    "gateway.serving.serve": _patch_serve,
    "gateway.http.streaming": _patch_streaming,
    "workers.transport.handles": _patch_handles,
    "workers.transport.channel": _patch_channel,
    "workers.actor": _patch_actor,
    "vllm.entrypoints.openai.chat_completion.serving": _patch_vllm_chat,
    "vllm.v1.engine.async_llm": _patch_async_llm,
}


class PatchingFinder(importlib.abc.MetaPathFinder):
    """Applies ``patches[module name](module)`` right after the module runs (before anyone
    imports its names)."""

    def __init__(self, patches: dict, label: str):
        self.patches, self.label = patches, label

    def find_spec(self, name, path, target=None):
        if name not in self.patches:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def patched(module):
            exec_module(module)
            try:
                self.patches[name](module)
            except AttributeError as e:  # the code moved on: patch the rest
                print(f"{self.label}: {name} not patched: {e}", file=sys.stderr)
        spec.loader.exec_module = patched
        return spec


def install() -> None:
    """Run from ``sitecustomize`` in every process: tracing when ``TANDEM_HOPTRACE_FILE`` is set."""
    global _fd
    if os.environ.get(ENV):
        _fd = os.open(os.environ[ENV], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        sys.meta_path.insert(0, PatchingFinder(PATCHES, "hoptrace"))


# -- analysis (pure) ----------------------------------------------------------------------------
def first_in_windows(events: list[tuple[int, str]], windows: list[tuple[int, int]]) -> list[dict[str, int]]:
    """For each client window [start, end], the first time of every event inside it, relative
    to the start (ns)."""
    out = []
    for start, end in windows:
        firsts: dict[str, int] = {}
        for t, name in events:
            if start <= t <= end and name not in firsts:
                firsts[name] = t - start
        out.append(firsts)
    return out


def hop_table(per_request: list[dict[str, int]], hops=HOPS) -> list[tuple[str, str, float, float]]:
    """(event, description, median ms from send, median ms since the previous hop present)."""
    rows = []
    prev = None
    for event, what in hops:
        at = [r[event] for r in per_request if event in r]
        if not at:
            continue
        gaps = [r[event] - r[prev] for r in per_request if event in r and prev in r] if prev else at
        rows.append((event, what, statistics.median(at) / 1e6, statistics.median(gaps) / 1e6 if gaps else 0.0))
        prev = event
    return rows


def format_hops(tables: dict[str, list[tuple[str, str, float, float]]]) -> str:
    names = list(tables)
    lines = ["| hop | " + " | ".join(f"{n}: gap ms (at ms)" for n in names) + " |",
             "|---|" + "---|" * len(names)]
    for event, what in HOPS:
        cells = []
        for n in names:
            row = next((r for r in tables[n] if r[0] == event), None)
            cells.append(f"{row[3]:.2f} ({row[2]:.2f})" if row else "-")
        if any(c != "-" for c in cells):
            lines.append(f"| {what} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- the run ------------------------------------------------------------------------------------
def _client(port: int, n: int, max_tokens: int) -> tuple[list[tuple[int, int, int]], list[tuple[int, str]]]:
    """n sequential streaming chats: (send, first event with choices, end) in monotonic ns, and
    a ``c_event`` at each event's arrival."""
    import json

    import httpx

    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "the quick brown fox " * 6}],
            "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "temperature": 0}
    out, arrivals = [], []
    with httpx.Client(timeout=60) as client:
        for i in range(n + 3):
            t0 = time.monotonic_ns()
            first = None
            mine = []
            with client.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                        mine.append((time.monotonic_ns(), "c_event"))
                        first = first or mine[-1][0]
            if i >= 3:  # warm-up
                out.append((t0, first or time.monotonic_ns(), time.monotonic_ns()))
                arrivals += mine
            time.sleep(0.05)  # let the previous request's tail events land before the next window
    return out, arrivals


STREAM_STAGES = [("v_output", "engine output reaches vLLM's serving layer"), ("v_chunk", "vLLM SSE chunk"),
                 ("a_yield", "actor hands a batch to the transport"), ("g_feed", "gateway receives a batch"),
                 ("g_send_body", "gateway writes a body message"), ("c_event", "client reads an event")]


def stage_gaps(events: list[tuple[int, str]], windows: list[tuple[int, int]], stages=STREAM_STAGES) -> dict:
    """{stage: (p50, p99, max) ms} of the gaps between consecutive occurrences within a window:
    where a stall in the stream first shows."""
    out = {}
    for name, _ in stages:
        gaps = []
        for start, end in windows:
            times = [t for t, n in events if n == name and start <= t <= end]
            gaps += [b - a for a, b in zip(times, times[1:], strict=False)]
        if gaps:
            gaps.sort()
            out[name] = (gaps[len(gaps) // 2] / 1e6, gaps[int(0.99 * (len(gaps) - 1))] / 1e6, gaps[-1] / 1e6)
    return out


def format_gaps(tables: dict[str, dict]) -> str:
    names = list(tables)
    lines = ["| stream stage | " + " | ".join(f"{n}: gap p50 / p99 / max ms" for n in names) + " |",
             "|---|" + "---|" * len(names)]
    for stage, what in STREAM_STAGES:
        cells = ["{:.2f} / {:.2f} / {:.1f}".format(*tables[n][stage]) if stage in tables[n] else "-" for n in names]
        if any(c != "-" for c in cells):
            lines.append(f"| {what} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(target: str, port: int, n: int, max_tokens: int, workdir: Path) -> tuple[list[dict[str, int]], dict]:
    from tandem_tools.bench.servers import Server
    from tandem_tools.bench.setups import build_setups, site_dir
    from workers import tiny_models

    site = site_dir(workdir)
    trace = workdir / f"{target}.trace"
    trace.unlink(missing_ok=True)
    repo = str(Path(__file__).resolve().parents[2])
    args = argparse.Namespace(port=port)
    model_path = str(tiny_models.build(tiny_models.TINY_LLAMA))
    setup = build_setups(args, model_path, workdir)[target]
    server: Server = setup.servers[-1]
    server.env = {**server.env, ENV: str(trace),
                  "PYTHONPATH": os.pathsep.join([str(site), repo, os.environ.get("PYTHONPATH", "")])}
    with server:
        server.wait_ready(600)
        windows, arrivals = _client(port, n, max_tokens)
    events = list(arrivals)
    for line in trace.read_text().splitlines():
        t, name, _pid = line.split()
        events.append((int(t), name))
    events.sort()
    per_request = first_in_windows(events, [(s, e) for s, _, e in windows])
    for r, (s, f, _) in zip(per_request, windows, strict=True):
        r["c_first"] = f - s
    return per_request, stage_gaps(events, [(s, e) for s, _, e in windows])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem_tools.bench.hoptrace", description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default="direct,tandem")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--port", type=int, default=8131)
    args = p.parse_args(argv)
    tables, gaps = {}, {}
    workdir = Path(tempfile.mkdtemp(prefix="tandem-hoptrace-"))  # kept: the servers' logs and the traces
    for target in args.targets.split(","):
        per_request, gaps[target] = run(target, args.port, args.requests, args.max_tokens, workdir)
        tables[target] = hop_table(per_request)
    print(f"median of {args.requests} sequential streaming chats ({args.max_tokens} tokens); traces in {workdir}")
    print(format_hops(tables))
    print()
    print(format_gaps(gaps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
