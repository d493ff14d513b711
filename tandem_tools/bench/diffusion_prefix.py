"""`tandem bench --mode diffusion-prefix`: the diffusion prefix cache on against off.

One diffusion engine in this process at a time (fast sampler; ``prefix_cache`` on, then off, in
interleaved rounds), on ``shape-diffusiongemma-deep`` by default (DiffusionGemma's canvas and
vocabulary on a trunk of 8 layers 1,024 wide, where a long prompt's encoder pass costs seconds).
Each run, through the engine's own routes (completions, streamed):

1. filler: ``--fillers`` prompts (default 2) of the shared prompt's length that share nothing
   with it (the cache holds other pages when the shared load arrives; with a small
   ``--memory-budget-gib`` or many fillers they must give way);
2. shared: ``--requests`` requests (default 16) sharing a ``--shared-tokens`` system prompt (default
   4,000) with a short question each: one first, the rest together once it has its first token;
3. conversation: ``--turns`` turns (default 4) of one conversation, each resending the history
   (previous prompt + answer + a new question).

Reported per run: prompt tokens computed (the engine's prefix-cache counters: queried less hit),
TTFT p50/p90 (to the first committed block), output tokens/s, the most memory the engine reserved
and the process's RSS growth, and failed requests; then the ratios on/off.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from workers import tiny_models

DEFAULT_MODEL = tiny_models.SHAPE_DIFFUSIONGEMMA_DEEP


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("diffusion prefix-cache mode (--mode diffusion-prefix)")
    g.add_argument("--shared-tokens", type=int, default=4000,
                   help="diffusion-prefix: tokens of the system prompt the shared load shares (default: 4000)")
    g.add_argument("--turns", type=int, default=4, help="diffusion-prefix: turns of the conversation (default: 4)")
    g.add_argument("--threads", type=int, default=1, help="diffusion-prefix: the engine's torch threads (default: 1)")
    g.add_argument("--fillers", type=int, default=2, help="diffusion-prefix: prompts sharing nothing sent first, "
                   "to fill the cache (with a small --memory-budget-gib its pages must give way) (default: 2)")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _words(tok, n_tokens: int, seed: int) -> str:
    """Text of about ``n_tokens`` tokens (ordinary words, a seed apart share nothing)."""
    words, i = [], 0
    text = ""
    while True:
        words.append(f"w{(seed * 7919 + i * 104729) % 100003}")
        i += 1
        if i % 64 == 0:
            text = " ".join(words)
            if len(tok(text).input_ids) >= n_tokens:
                return text


async def _run(engine_args: dict, model_path: str, args) -> dict:
    from diffusion_plugin.engine import DiffusionEngine

    engine = DiffusionEngine("m", model_path, engine_args)
    await engine.start()
    tok = engine.adapter.tokenizer
    rss0, peak = _rss_bytes(), {"reserved": 0, "rss": 0}
    ttfts: dict[str, list[float]] = {"shared": [], "conversation": []}
    out_tokens, failures, cached = 0, 0, {"shared": [], "conversation": []}
    # logprobs: every committed block is a chunk even where its tokens have no text (the shape models'
    # ids past the tiny tokenizer's): the first one's arrival is the TTFT.
    sampling = {"max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0, "stream": True, "logprobs": 0,
                "stream_options": {"include_usage": True}, "diffusion": {"max_denoising_steps": args.steps or 2}}

    async def watch():
        while True:
            s = await engine.stats()
            peak["reserved"] = max(peak["reserved"], s.extra.get("memory_reserved_bytes") or 0)
            peak["rss"] = max(peak["rss"], _rss_bytes() - rss0)
            await asyncio.sleep(0.25)

    async def one(prompt: str, phase: str | None, first: asyncio.Event | None = None) -> str:
        nonlocal out_tokens, failures
        t0 = time.perf_counter()
        text, ttft = "", None
        try:
            async for item in engine.completions({"model": "m", "prompt": prompt, **sampling}, f"r{time.time_ns()}"):
                if not isinstance(item, str):
                    raise RuntimeError(getattr(item, "message", repr(item)))
                if not item.startswith("data: {"):
                    continue
                chunk = json.loads(item[len("data: "):])
                if chunk.get("usage"):
                    out_tokens += chunk["usage"]["completion_tokens"]
                    if phase:
                        details = chunk["usage"].get("prompt_tokens_details") or {}
                        cached[phase].append(details.get("cached_tokens", 0))
                for c in chunk["choices"]:
                    if (c.get("text") or c.get("logprobs")) and ttft is None:
                        ttft = time.perf_counter() - t0
                        if first is not None:
                            first.set()
                    text += c.get("text") or ""
        except Exception as e:  # noqa: BLE001 - counted and printed, the run goes on
            failures += 1
            print(f"  request failed: {e}", flush=True)
        if first is not None:
            first.set()
        if phase and ttft is not None:
            ttfts[phase].append(ttft)
        return text

    watcher = asyncio.create_task(watch())
    t0 = time.perf_counter()

    def mark(what):
        print(f"  {time.perf_counter() - t0:7.1f} s  {what}", flush=True)
    try:
        for k in range(args.fillers):  # 1. filler
            await one(_words(tok, args.shared_tokens, 1000 + k) + "\nQ: first?\nA:", None)
            mark(f"filler {k} done")
        shared = _words(tok, args.shared_tokens, 1)  # 2. the shared load
        questions = [f"\nQuestion {i}: what is item {i * 37 % 101}?\nAnswer:" for i in range(args.requests or 16)]
        first = asyncio.Event()
        lead = asyncio.create_task(one(shared + questions[0], "shared", first))
        await first.wait()
        mark("shared: the first has its first token")
        await asyncio.gather(lead, *(one(shared + q, "shared") for q in questions[1:]))
        mark("shared: all done")
        history = _words(tok, 1000, 2)  # 3. the conversation
        for turn in range(args.turns):
            prompt = history + f"\nUser: tell me about topic {turn}.\nAssistant:"
            answer = await one(prompt, "conversation")
            history = prompt + answer
            mark(f"conversation turn {turn} done")
        wall = time.perf_counter() - t0
        stats = (await engine.stats()).extra
    finally:
        watcher.cancel()
        await engine.shutdown()
    queries, hits = stats.get("prefix_cache_queries"), stats.get("prefix_cache_hits")

    def pct(xs, q):
        return statistics.quantiles(xs, n=10)[q // 10 - 1] if len(xs) >= 2 else (xs[0] if xs else float("nan"))

    return {"computed_prompt_tokens": None if queries is None else queries - hits, "queried": queries, "hits": hits,
            "ttft_p50_shared": pct(ttfts["shared"], 50), "ttft_p90_shared": pct(ttfts["shared"], 90),
            "ttft_conversation": ttfts["conversation"], "cached_shared": cached["shared"],
            "cached_conversation": cached["conversation"], "tokens_per_s": out_tokens / wall, "wall_s": wall,
            "evictions": stats.get("prefix_cache_evictions", 0),
            "peak_reserved_gib": peak["reserved"] / 2**30, "peak_rss_growth_gib": peak["rss"] / 2**30,
            "failures": failures}


def main(args: argparse.Namespace) -> int:
    import torch

    name = DEFAULT_MODEL if args.model in ("tiny-diffusiongemma", None) else args.model
    path = str(tiny_models.build(name)) if name in tiny_models.BUILDERS else name
    torch.set_num_threads(1)
    torch.set_num_threads(args.threads)
    base = {"sampler": "fast", "num_threads": args.threads, "max_batch": args.max_batch or 16}
    if args.memory_budget_gib:
        base["memory_budget_gib"] = args.memory_budget_gib
    results: dict[str, list[dict]] = {"on": [], "off": []}
    for rnd in range(args.rounds):
        for setup in (("on", "off") if rnd % 2 == 0 else ("off", "on")):
            r = asyncio.run(_run({**base, "prefix_cache": setup == "on"}, path, args))
            results[setup].append(r)
            print(f"round {rnd} cache {setup}: {json.dumps(r)}", flush=True)

    def med(setup, key):
        vals = [r[key] for r in results[setup] if r[key] is not None]
        return statistics.median(vals) if vals else float("nan")

    print(f"\n{name}: {args.requests or 16} requests sharing a {args.shared_tokens}-token prompt, a {args.turns}-turn "
          f"conversation, {args.max_tokens} output tokens, {args.steps or 2} steps; medians of {args.rounds} rounds\n")
    print("| metric | cache off | cache on | on / off |")
    print("|---|---|---|---|")
    for key, label in (("computed_prompt_tokens", "prompt tokens computed (all phases)"),
                       ("ttft_p50_shared", "TTFT p50, shared load (s)"),
                       ("ttft_p90_shared", "TTFT p90, shared load (s)"),
                       ("tokens_per_s", "output tokens/s"), ("peak_reserved_gib", "peak memory reserved (GiB)"),
                       ("peak_rss_growth_gib", "peak RSS growth (GiB)"), ("evictions", "cached pages evicted"),
                       ("failures", "failed requests")):
        off, on = med("off", key), med("on", key)
        ratio = f"{on / off:.2f}x" if off else "-"
        print(f"| {label} | {off:.3g} | {on:.3g} | {ratio} |")
    conv_on, conv_off = results["on"][-1]["ttft_conversation"], results["off"][-1]["ttft_conversation"]
    print(f"| conversation TTFT per turn (s) | {', '.join(f'{x:.2f}' for x in conv_off)} | "
          f"{', '.join(f'{x:.2f}' for x in conv_on)} | |")
    print(f"| conversation cached tokens per turn | - | {results['on'][-1]['cached_conversation']} | |")
    if args.out:
        Path(args.out).write_text(json.dumps({"model": name, "results": results}, indent=1))
    return 0
