"""`python -m tandem_tools.bench.sampling`: what vLLM's sampling fields and prompt scoring cost a
diffusion row, at the real shape.

The diffusion runner in this process (one engine alive at a time, one torch thread as in a Ray
actor), on ``shape-diffusiongemma`` (DiffusionGemma's canvas, 256, and vocabulary, 262,144): the
same requests with no field and with each of ``top_k``, ``top_p``, ``min_p``, an allowed set and
``min_tokens``, for each sampler and concurrency, in interleaved rounds; then prompt scoring (echo
with logprobs: a prompt read in score blocks, ``max_tokens`` 0) against encoding the same prompt
and generating one block.

The shape model's weights are random, so its distributions are nearly flat: ``top_p`` keeps most
of the vocabulary at every position and falls back to a full sort there (its worst case). The
``--micro`` table times ``filters.apply`` alone on a canvas x vocabulary of logits, flat and peaked
(a trained model's: the top few ids hold most of the mass).

Reported per setup: seconds per batched denoise step, CPU seconds per row-step (this process's CPU
time over rows x steps: the figure the box reproduces best) and its ratio to no field.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

VARIANTS = {
    "none": {},
    "top_k=50": {"top_k": 50},
    "top_p=0.9": {"top_p": 0.9},
    "min_p=0.05": {"min_p": 0.05},
    "allowed=1000": {"allowed_token_ids": tuple(range(2000, 3000))},  # (EOS is not among them)
    "min_tokens=256": {"min_tokens": 256},
}


def run_setup(adapter, sampler: str, c: int, fields: dict, args) -> dict:
    from diffusion_plugin.batcher.request import SamplingParams, Sequence
    from diffusion_plugin.batcher.scheduler import Scheduler
    from diffusion_plugin.step.runner import Runner

    sched = Scheduler(max_batch=c, canvas_length=adapter.canvas_length, row_boundaries=False)
    runner, seqs = Runner(adapter, sampler, chunk_rows=1), {}
    for i in range(c):
        params = SamplingParams(max_tokens=args.max_tokens, seed=11 + i, eos_token_ids=adapter.eos_token_ids,
                                **{**adapter.defaults(), "max_denoising_steps": args.steps}, **fields)
        prompt = [(7 * i + 13 * j) % 1000 + 6 for j in range(24 + 16 * i)]
        seq = Sequence(seq_id=f"s{i}", prompt_ids=prompt, params=params)
        seqs[seq.seq_id] = seq
        sched.add(seq)
    return drive(sched, runner, seqs)


def drive(sched, runner, seqs) -> dict:
    """Runs the scheduler's sequences to the end: timings and counts (also ``bench_grammar``'s)."""
    cpu0, t0, steps, row_steps = time.process_time(), time.perf_counter(), 0, 0
    while sched.has_work():
        batch, _ = sched.schedule()
        if batch.empty():
            continue
        sched.update(runner.execute(batch, seqs))
        if batch.denoise:
            steps += 1
            row_steps += len(batch.denoise)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {"wall_s": wall, "cpu_s": cpu, "steps": steps, "row_steps": row_steps,
            "tokens": sum(len(s.output_ids) for s in seqs.values()),
            "s_per_step": wall / max(steps, 1), "cpu_s_per_row_step": cpu / max(row_steps, 1)}


def run_scoring(adapter, sampler: str, prompt_len: int, scored: bool, args) -> dict:
    """One prompt: read in score blocks (max_tokens 0), or encoded at once and one block generated."""
    from diffusion_plugin.batcher.request import SamplingParams, Sequence
    from diffusion_plugin.batcher.scheduler import Scheduler
    from diffusion_plugin.step.runner import Runner

    prompt = [(13 * j) % 1000 + 6 for j in range(prompt_len)]
    params = SamplingParams(max_tokens=0 if scored else adapter.canvas_length, seed=3, eos_token_ids=(),
                            **{**adapter.defaults(), "max_denoising_steps": args.steps})
    seq = Sequence("s", prompt[:1] if scored else prompt, params, score_ids=prompt[1:] if scored else [], score_k=1)
    sched = Scheduler(max_batch=1, canvas_length=adapter.canvas_length)
    sched.add(seq)
    r = drive(sched, Runner(adapter, sampler, chunk_rows=1), {"s": seq})
    r["scored"] = len(seq.scores)
    return r


def micro(adapter, rounds: int) -> list[dict]:
    import torch

    from diffusion_plugin.batcher.request import SamplingParams
    from diffusion_plugin.step import filters
    from diffusion_plugin.step.attention import MIN_EXPONENT

    C, V = adapter.canvas_length, adapter.vocab_size
    g = torch.Generator().manual_seed(0)
    shapes = {"flat": torch.randn(C, V, generator=g),
              "peaked": torch.randn(C, V, generator=g) * 3.0}
    peaked = shapes["peaked"]
    top = torch.randint(0, V, (C, 8), generator=g)
    peaked.scatter_(1, top, peaked.max(-1, keepdim=True).values + torch.linspace(12, 4, 8).expand(C, 8))
    rows = []
    for name, fields in VARIANTS.items():
        if not fields:
            continue
        p = SamplingParams(max_tokens=256, max_denoising_steps=8, entropy_bound=1, t_min=1, t_max=1,
                           stability_threshold=1, confidence_threshold=1, seed=0, eos_token_ids=(1,), **fields)
        for kind, x in shapes.items():
            cpu, fast = [], []
            for _ in range(rounds):
                y = x.clone()
                t = time.process_time()
                filters.apply(y, p, 0)
                cpu.append(time.process_time() - t)
                z = x.clone()  # fast mode's form, as in its fused step (the max, shift and exp not counted)
                t = time.process_time()
                filters.prepare(z, p, 0)
                fast.append(time.process_time() - t)
                z.sub_(z.max(dim=-1, keepdim=True).values).clamp_(min=MIN_EXPONENT)
                e = torch.exp(z)
                t = time.process_time()
                filters.cut(z, e, p, 0)
                fast[-1] += time.process_time() - t
            rows.append({"field": name, "logits": kind, "cpu_s": statistics.median(cpu),
                         "fast_cpu_s": statistics.median(fast),
                         "kept_per_position": float((~torch.isinf(y)).sum(-1).float().mean())})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="shape-diffusiongemma", help="built-in model (default: shape-diffusiongemma)")
    p.add_argument("--samplers", default="fast,exact", help="samplers (default: fast,exact)")
    p.add_argument("--concurrency", default="1,4", help="sequences per batch (default: 1,4)")
    p.add_argument("--exact-concurrency", default="1", help="exact mode's (slow on CPU; default: 1)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="fields to time (default: all)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default: 2)")
    p.add_argument("--max-tokens", type=int, default=256, help="max_tokens per sequence (default: 256)")
    p.add_argument("--steps", type=int, default=8, help="max_denoising_steps (default: 8)")
    p.add_argument("--score-tokens", type=int, default=1024, help="the scored prompt's length (default: 1024; "
                   "0: skip scoring)")
    p.add_argument("--micro", action="store_true", help="also time the fields alone (both forms), flat and peaked "
                   "logits")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)

    import torch

    from diffusion_plugin.families import load_adapter
    from workers import tiny_models

    torch.set_num_threads(1)
    adapter = load_adapter("diffusiongemma", str(tiny_models.build(args.model)))
    print(f"{args.model}: canvas {adapter.canvas_length}, vocabulary {adapter.vocab_size}", flush=True)
    variants = args.variants.split(",")
    setups = [(s, int(c), v) for s in args.samplers.split(",")
              for c in (args.exact_concurrency if s == "exact" else args.concurrency).split(",") for v in variants]
    scoring = [(s, scored) for s in args.samplers.split(",") for scored in (False, True)] if args.score_tokens else []
    results: dict[tuple, list[dict]] = {k: [] for k in setups + scoring}
    for rnd in range(args.rounds):
        order = setups + scoring
        for key in order if rnd % 2 == 0 else list(reversed(order)):
            if len(key) == 3:
                sampler, c, v = key
                r = run_setup(adapter, sampler, c, VARIANTS[v], args)
                print(f"round {rnd} {sampler} c={c} {v}: {r['s_per_step']:.3f} s/step, "
                      f"{r['cpu_s_per_row_step']:.3f} CPU s/row-step, {r['tokens']} tokens, {r['steps']} steps",
                      flush=True)
            else:
                sampler, scored = key
                r = run_scoring(adapter, sampler, args.score_tokens, scored, args)
                print(f"round {rnd} {sampler} {'score' if scored else 'generate one block'} "
                      f"({args.score_tokens}-token prompt): {r['wall_s']:.2f} s, {r['cpu_s']:.2f} CPU s, "
                      f"{r['scored']} scored, {r['tokens']} generated", flush=True)
            results[key].append(r)
    rev = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True).stdout.strip()

    def med(rs, k):
        return statistics.median(r[k] for r in rs)

    print(f"\nmedians of {args.rounds} rounds (commit {rev}); ratio = with the field / none")
    print("| sampler | c | field | s/step | ratio | CPU s/row-step | ratio |")
    print("|---|---|---|---|---|---|---|")
    table = []
    for sampler, c, v in setups:
        base, rs = results[(sampler, c, "none")], results[(sampler, c, v)]
        row = {"sampler": sampler, "c": c, "field": v, "s_per_step": med(rs, "s_per_step"),
               "cpu_s_per_row_step": med(rs, "cpu_s_per_row_step"),
               "ratio_step": med(rs, "s_per_step") / med(base, "s_per_step"),
               "ratio_cpu": med(rs, "cpu_s_per_row_step") / med(base, "cpu_s_per_row_step")}
        table.append(row)
        print(f"| {sampler} | {c} | {v} | {row['s_per_step']:.3f} | {row['ratio_step']:.2f}x | "
              f"{row['cpu_s_per_row_step']:.3f} | {row['ratio_cpu']:.2f}x |")
    if scoring:
        print(f"\nscoring a {args.score_tokens}-token prompt (max_tokens 0) vs encoding it and generating one block")
        print("| sampler | score: wall s | CPU s | CPU ms per scored token | generate one block: wall s | CPU s |")
        print("|---|---|---|---|---|---|")
        for sampler in args.samplers.split(","):
            sc, gen = results[(sampler, True)], results[(sampler, False)]
            print(f"| {sampler} | {med(sc, 'wall_s'):.2f} | {med(sc, 'cpu_s'):.2f} | "
                  f"{1000 * med(sc, 'cpu_s') / max(args.score_tokens - 1, 1):.1f} | {med(gen, 'wall_s'):.2f} | "
                  f"{med(gen, 'cpu_s'):.2f} |")
    micro_rows = micro(adapter, max(args.rounds, 3)) if args.micro else []
    if micro_rows:
        print("\nthe fields alone on one canvas x vocabulary of logits (CPU s, median): exact mode's "
              "filters.apply, fast mode's prepare + cut")
        print("| field | logits | exact: CPU s | fast: CPU s | tokens kept per position |")
        print("|---|---|---|---|---|")
        for r in micro_rows:
            print(f"| {r['field']} | {r['logits']} | {r['cpu_s']:.3f} | {r['fast_cpu_s']:.3f} | "
                  f"{r['kept_per_position']:.0f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"commit": rev, "rows": table, "micro": micro_rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
