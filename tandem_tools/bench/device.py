"""`python -m tandem_tools.bench.device`: the diffusion batcher in this process on one device, for a
lent GPU machine, where neither Ray nor vLLM is installed (only torch and transformers).

What ``tandem bench --mode diffusion`` and ``--mode diffusion-prefix`` measure through the gateway,
measured here below it (scheduler + runner + the DiffusionGemma adapter, as the engine's loop
drives them; no HTTP, no actor), so the figures are the engine's own:

- ``throughput`` (``shape-diffusiongemma``): HF ``generate()`` one request at a time and as one
  static batch of equal-length prompts, against tandem exact and fast, with ``c`` requests
  submitted at once (``max_batch`` = c), in interleaved rounds. Per target and level: output
  tokens/s, seconds per (batched) denoise step, CPU seconds per output token (this process) and
  peak device memory growth per row.
- ``prefix`` (``shape-diffusiongemma-deep``): ``--prefix-requests`` requests sharing a
  ``--shared-tokens`` prompt (one first, the rest together once it has its first block), fast
  mode with the prefix cache on against off, interleaved: prompt tokens computed, time to the
  first committed block p50/p90, and the ratios.

Prints one JSON line per measurement and a summary table; ``--out`` writes all of it as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

TEXTS = [
    "Hello there",
    "Tell me about the river and the sea, and the fishermen who mend their nets on the quay.",
    "def add(a, b):",
    "Numbers and dates appear everywhere: 1, 2, 3, 10, 42, 100, 256 " * 4,
    "Write a short poem about autumn leaves falling in a quiet park.",
    "Summarise the plot of a detective story in three sentences.",
    "What is the capital of France, and why is it famous?",
    "List five prime numbers and explain what makes them prime.",
]
GIB = 1 << 30


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _mem_reset(device: str) -> int:
    import torch

    if not device.startswith("cuda"):
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _mem_peak(device: str, base: int) -> float:
    import torch

    return (torch.cuda.max_memory_allocated() - base) / (1 << 20) if device.startswith("cuda") else 0.0


def _count(row: list[int], eos: set[int], max_tokens: int) -> int:
    cut = next((i for i, t in enumerate(row) if t in eos), None)
    return min(cut if cut is not None else len(row), max_tokens)


def _params(adapter, max_tokens: int, steps: int, seed: int):
    from diffusion_plugin.batcher.request import SamplingParams

    return SamplingParams(max_tokens=max_tokens, seed=seed, eos_token_ids=adapter.eos_token_ids,
                          **{**adapter.defaults(), "max_denoising_steps": steps})


def run_tandem(adapter, sampler: str, prompts: list[list[int]], args, kv_budget: int, rowwise: bool = False,
               **compiled) -> dict:
    """All prompts submitted at once, ``max_batch`` = their count: tokens/s, s/step, memory.
    ``compiled``: the Runner's ``compiled_trunk``, ``cuda_graphs``, ``compiled_vocab``, ``chunk_rows``."""
    from diffusion_plugin.batcher.request import Sequence
    from diffusion_plugin.batcher.scheduler import Scheduler
    from diffusion_plugin.step.runner import Runner

    c = len(prompts)
    sched = Scheduler(max_batch=c, canvas_length=adapter.canvas_length)
    runner = Runner(adapter, sampler=sampler, kv_budget_bytes=kv_budget, rowwise=rowwise, **compiled)
    seqs = {}
    for i, p in enumerate(prompts):
        seq = Sequence(seq_id=f"s{i}", prompt_ids=p, params=_params(adapter, args.max_tokens, args.steps, 100 + i))
        seqs[seq.seq_id] = seq
        sched.add(seq)
    from tandem_tools.bench.sampling import drive

    base = _mem_reset(args.device)
    r = drive(sched, runner, seqs)  # (each step's results are read back to the host: synchronous)
    return {"tokens_per_s": r["tokens"] / r["wall_s"], "tokens": r["tokens"], "wall_s": r["wall_s"],
            "s_per_step": r["s_per_step"], "cpu_ms_per_token": 1000 * r["cpu_s"] / max(r["tokens"], 1),
            "peak_mb_per_row": _mem_peak(args.device, base) / c}


def run_hf(model, prompts: list[list[int]], args, eos: set[int], static: bool) -> dict:
    import torch

    device = args.device
    if static:  # equal-length prompts (HF batches need one shared cache): the median length
        length = sorted(len(p) for p in prompts)[len(prompts) // 2]
        batches = [[(p * (length // len(p) + 1))[:length] for p in prompts]]
    else:
        batches = [[p] for p in prompts]
    base = _mem_reset(device)
    cpu0, t0, tokens = time.process_time(), time.perf_counter(), 0
    for b in batches:
        out = model.generate(torch.tensor(b, device=device), max_new_tokens=args.max_tokens,
                             max_denoising_steps=args.steps)
        tokens += sum(_count(r, eos, args.max_tokens) for r in out.sequences[:, len(b[0]):].tolist())
    _sync(device)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    rows = len(batches[0])
    return {"tokens_per_s": tokens / wall, "tokens": tokens, "wall_s": wall,
            "cpu_ms_per_token": 1000 * cpu / max(tokens, 1), "peak_mb_per_row": _mem_peak(device, base) / rows}


def throughput(args, path: str) -> dict:
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    from diffusion_plugin.batcher.memory import DEVICE_CHUNK_ROWS
    from diffusion_plugin.families import load_adapter

    adapter = load_adapter("diffusiongemma", path, device=args.device)
    tok = adapter.tokenizer
    texts = [TEXTS[i % len(TEXTS)] for i in range(max(args.levels))]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for t in texts]
    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=torch.float32).to(args.device).eval()
    eos = set(adapter.eos_token_ids)
    kv_budget = int(args.kv_budget_gib * GIB)
    targets = {"hf sequential": lambda ps: run_hf(hf, ps, args, eos, False),
               "hf static batch": lambda ps: run_hf(hf, ps, args, eos, True),
               "tandem exact": lambda ps: run_tandem(adapter, "exact", ps, args, kv_budget),
               "tandem fast": lambda ps: run_tandem(adapter, "fast", ps, args, kv_budget),
               # each row through the passes alone (Runner's rowwise): what batching gains
               "tandem fast rowwise": lambda ps: run_tandem(adapter, "fast", ps, args, kv_budget, True)}
    if args.graphs:  # the device form: the trunk compiled and replayed as CUDA graphs (engine_args.cuda_graphs),
        # each chunk's vocabulary pass, the draws and the acceptance compiled (compiled_vocab), a device's chunks
        targets["tandem fast graphs"] = lambda ps: run_tandem(adapter, "fast", ps, args, kv_budget, compiled_trunk=True,
                                                              cuda_graphs=True, compiled_vocab=True,
                                                              chunk_rows=DEVICE_CHUNK_ROWS)
    for fn in targets.values():  # warm-up: CUDA context, cuBLAS handles, allocator (and compilation)
        fn(prompts[:1])
    if args.graphs:  # the several-rows graphs too (captured at their second call)
        targets["tandem fast graphs"](prompts[:2])
    runs: dict[str, dict[int, list[dict]]] = {n: {c: [] for c in args.levels} for n in targets}
    for r in range(args.rounds):
        for c in args.levels:
            names = list(targets) if r % 2 == 0 else list(reversed(targets))
            for name in names:
                if name == "hf static batch" and c == 1:
                    continue
                res = targets[name](prompts[:c])
                runs[name][c].append(res)
                print(json.dumps({"section": "throughput", "round": r, "target": name, "c": c, **res}), flush=True)
    summary = {n: {c: _median(v) for c, v in levels.items() if v} for n, levels in runs.items()}
    return summary


def _median(rows: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def _shared_ids(n: int, seed: int, vocab: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(vocab // 8, vocab - vocab // 8) for _ in range(n)]


def run_prefix(adapter, prompts: list[list[int]], cache: bool, args) -> dict:
    """One request first, the rest together once it has its first block: TTFT and tokens computed."""
    from diffusion_plugin.batcher.request import Sequence
    from diffusion_plugin.batcher.scheduler import Scheduler
    from diffusion_plugin.step.runner import Runner

    sched = Scheduler(max_batch=len(prompts), canvas_length=adapter.canvas_length)
    runner = Runner(adapter, sampler="fast", kv_budget_bytes=int(args.kv_budget_gib * GIB), prefix_cache=cache)
    seqs, added, first = {}, {}, {}

    def add(i: int) -> None:
        seq = Sequence(seq_id=f"s{i}", prompt_ids=prompts[i], params=_params(adapter, args.prefix_max_tokens, 2, 7 + i))
        seqs[seq.seq_id] = seq
        added[seq.seq_id] = time.perf_counter()
        sched.add(seq)

    add(0)
    base = _mem_reset(args.device)
    t0 = time.perf_counter()
    while sched.has_work() or len(seqs) < len(prompts):
        if len(seqs) == 1 and "s0" in first:
            for i in range(1, len(prompts)):
                add(i)
        batch, _ = sched.schedule()
        if not batch.empty():
            sched.update(runner.execute(batch, seqs))
        now = time.perf_counter()
        for sid, s in seqs.items():
            if sid not in first and s.output_ids:
                first[sid] = now - added[sid]
    _sync(args.device)
    wall = time.perf_counter() - t0
    stats = runner.prefix_stats()
    ttft = sorted(first.values())
    total = sum(len(p) for p in prompts)
    return {"cache": cache, "prompt_tokens": total, "prompt_tokens_cached": sum(s.cached_tokens for s in seqs.values()),
            "prompt_tokens_computed": total - sum(s.cached_tokens for s in seqs.values()),
            "ttft_p50_ms": 1000 * ttft[len(ttft) // 2],
            "ttft_p90_ms": 1000 * ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
            "tokens_per_s": sum(len(s.output_ids) for s in seqs.values()) / wall, "wall_s": wall,
            "peak_mb": _mem_peak(args.device, base), **stats}


def prefix(args, path: str) -> dict:
    from diffusion_plugin.families import load_adapter

    adapter = load_adapter("diffusiongemma", path, device=args.device)
    shared = _shared_ids(args.shared_tokens, 1, adapter.vocab_size)
    prompts = [shared + _shared_ids(16, 100 + i, adapter.vocab_size) for i in range(args.prefix_requests)]
    run_prefix(adapter, prompts[:2], True, args)  # warm-up
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for r in range(args.rounds):
        for cache in ((True, False) if r % 2 == 0 else (False, True)):
            res = run_prefix(adapter, prompts, cache, args)
            runs[cache].append(res)
            print(json.dumps({"section": "prefix", "round": r, **res}), flush=True)
    on, off = _median(runs[True]), _median(runs[False])
    ratios = {k: on[k] / off[k] for k in ("prompt_tokens_computed", "ttft_p50_ms", "ttft_p90_ms", "tokens_per_s")
              if off[k]}
    return {"on": on, "off": off, "on/off": ratios}


def table(summary: dict) -> str:
    lines = ["| target | c | tokens/s | s/step | CPU ms/token | peak MiB/row |", "|---|---|---|---|---|---|"]
    for name, levels in summary.items():
        for c, r in levels.items():
            lines.append(f"| {name} | {c} | {r['tokens_per_s']:.1f} | {r.get('s_per_step', float('nan')):.4f} | "
                         f"{r['cpu_ms_per_token']:.2f} | {r['peak_mb_per_row']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem_tools.bench.device", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="torch device (default: cuda)")
    p.add_argument("--sections", default="throughput,prefix", help="throughput, prefix (default: both)")
    p.add_argument("--model", default="", help="throughput's model (default: built-in shape-diffusiongemma)")
    p.add_argument("--prefix-model", default="", help="prefix's model (default: built-in shape-diffusiongemma-deep)")
    p.add_argument("--levels", default="1,4,16", help="throughput: requests at once (default: 1,4,16)")
    p.add_argument("--max-tokens", type=int, default=256, help="throughput: max_tokens (default: 256)")
    p.add_argument("--steps", type=int, default=8, help="denoise steps per block (default: 8)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default: 2)")
    p.add_argument("--kv-budget-gib", type=float, default=8.0, help="fast mode's KV pool (default: 8 GiB)")
    p.add_argument("--shared-tokens", type=int, default=4000, help="prefix: the shared prompt (default: 4000)")
    p.add_argument("--prefix-requests", type=int, default=16, help="prefix: requests (default: 16)")
    p.add_argument("--prefix-max-tokens", type=int, default=32, help="prefix: max_tokens (default: 32)")
    p.add_argument("--graphs", action="store_true", help="throughput: also tandem fast in its device form: the "
                   "trunk compiled and replayed as CUDA graphs, the vocabulary pass (a device engine's chunks of "
                   "rows), draws and acceptance compiled (engine_args.compiled_trunk + cuda_graphs + compiled_vocab; "
                   "compiled in the warm-up)")
    p.add_argument("--out", default="", help="write the summary as JSON here")
    args = p.parse_args(argv)
    args.levels = [int(x) for x in args.levels.split(",")]
    from workers import tiny_models

    out = {"device": args.device, "args": {k: v for k, v in vars(args).items()}}
    sections = args.sections.split(",")
    if "throughput" in sections:
        path = args.model or str(tiny_models.build(tiny_models.SHAPE_DIFFUSIONGEMMA))
        out["throughput"] = throughput(args, path)
        print(table(out["throughput"]), flush=True)
    if "prefix" in sections:
        path = args.prefix_model or str(tiny_models.build(tiny_models.SHAPE_DIFFUSIONGEMMA_DEEP))
        out["prefix"] = prefix(args, path)
        print(json.dumps({"prefix on/off": out["prefix"]["on/off"]}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
