"""`python -m tandem_tools.bench.vocab`: the fast mode's vocabulary pass at the real shape, against
its two-GEMM limit, eager and compiled by inductor (issue 36's CPU question).

One denoise step of one row on ``shape-diffusiongemma`` (canvas 256 x vocabulary 262,144, one
torch thread as in a Ray actor, CPU time, medians of ``--rounds``):
- **two-GEMM limit**: what no vocabulary pass can avoid, the head's GEMM (hidden -> logits) and the
  soft embedding's (probabilities -> hidden), each (C, H) x (H, V) into reused buffers;
- **eager**: ``diffusiongemma_vocab.fast_chunk`` as the runner calls it (the two GEMMs, softcap,
  temperature, max, exp, mass, entropy, the inverse-CDF draw: ~12 passes over C x V);
- **compiled**: ``fast_chunk`` with ``Scratch(compiled=True)`` (``engine_args.compiled_vocab``),
  as a row without top logprobs or pinned scores takes it: blocked over the vocabulary
  (``diffusiongemma_blocked``), each block's logits kept in the cache;
- **compiled_fused**: the compiled pass a row with top logprobs or pinned scores takes: the
  elementwise passes and reductions over the whole logits as one ``torch.compile``d (inductor)
  function per row, the GEMMs and the draw left as they are;
- **compiled_batched**: the device form's pass (``Scratch(compiled=True, batched=True)``, the
  default on a cuda device with ``compiled_vocab``): a chunk's whole pass as one compiled graph,
  its GEMMs ``bmm``s over the rows' canvas halves (``gemm.bmm_halves``).
The compilation is timed apart; the compiled passes' outputs are compared with eager's.

With ``--steps`` (default 4): whole fast denoise steps of the runner (the trunk and the vocabulary
pass) at 1 and 4 rows, CPU seconds a step: eager; the vocabulary pass compiled (the default on
the host); and with ``--trunk`` also the trunk compiled (``engine_args.compiled_trunk``: its
graphs compiled in as many untimed steps first).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def measure(model_name: str = "shape-diffusiongemma", rounds: int = 5, threads: int = 1, compile_: bool = True,
            steps: int = 0, trunk: bool = False) -> dict:
    import torch

    from diffusion_plugin.families import diffusiongemma_vocab as vocab
    from diffusion_plugin.families import load_adapter
    from workers import tiny_models

    torch.set_num_threads(threads)
    adapter = load_adapter("diffusiongemma", str(tiny_models.build(model_name)))
    model = adapter.model
    C, V = adapter.canvas_length, adapter.vocab_size
    weight, embed = model.lm_head.weight, model.model.decoder.embed_tokens
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, C, weight.shape[1], generator=g)
    inv_t = torch.tensor([1 / 0.6])
    uniform = torch.rand(1, C, generator=g, dtype=torch.float64)
    scratch = vocab.Scratch()
    x = torch.empty(1, C, V)
    soft = torch.empty(1, C, weight.shape[1])

    def limit():
        torch.matmul(hidden, weight.t(), out=x)
        torch.matmul(x, embed.weight, out=soft)

    def eager():
        return vocab.fast_chunk(model, hidden, inv_t, uniform, scratch)[:4]

    compiled_scratch = vocab.Scratch(compiled=True) if compile_ else None

    fused_scratch = vocab.Scratch(compiled=True) if compile_ else None
    if fused_scratch is not None:
        fused_scratch.plain = None  # the whole-logits kernel alone

    batched_scratch = vocab.Scratch(compiled=True, batched=True) if compile_ else None

    def compiled():
        return vocab.fast_chunk(model, hidden, inv_t, uniform, compiled_scratch)[:4]

    def compiled_batched():
        return vocab.fast_chunk(model, hidden, inv_t, uniform, batched_scratch)[:4]

    def compiled_fused():
        return vocab.fast_chunk(model, hidden, inv_t, uniform, fused_scratch)[:4]

    def cpu(fn) -> float:
        t = time.process_time()
        fn()
        return time.process_time() - t

    out = {"model": model_name, "canvas": C, "vocab": V, "hidden": weight.shape[1], "threads": threads,
           "torch": torch.__version__}
    cases = {"two_gemm_limit": limit, "eager": eager}
    if compiled_scratch is not None:
        t = time.perf_counter()
        with torch.inference_mode():
            compiled_scratch.warm(model, C, hidden.device)
        out["compile_s"] = round(time.perf_counter() - t, 1)
        with torch.inference_mode():
            fused_scratch.warm(model, C, hidden.device)
            batched_scratch.warm(model, C, hidden.device)
        cases.update(compiled=compiled, compiled_fused=compiled_fused, compiled_batched=compiled_batched)
        with torch.inference_mode():
            a = eager()
            for name in ("compiled", "compiled_fused", "compiled_batched"):
                b = cases[name]()
                out[f"{name}_vs_eager"] = {
                    "argmax_equal": bool(torch.equal(a[1], b[1])),
                    "sampled_equal_share": float((a[0] == b[0]).float().mean()),
                    "entropy_max_abs_diff": float((a[2] - b[2]).abs().max()),
                    "soft_max_rel_diff": float((a[3] - b[3]).abs().max() / a[3].abs().max()),
                }
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(rounds):  # interleaved
        for name, fn in cases.items():
            with torch.inference_mode():
                times[name].append(cpu(fn))
    out["cpu_s"] = {k: round(statistics.median(v), 4) for k, v in times.items()}
    base = out["cpu_s"]["two_gemm_limit"]
    out["x_limit"] = {k: round(v / base, 2) for k, v in out["cpu_s"].items()}
    if steps:
        out["step_cpu_s"] = {}
        for rows in (1, 4):
            runs: dict[str, list[float]] = {"eager": [], "compiled": [], **({"compiled_trunk": []} if trunk else {})}
            for _ in range(2):  # interleaved: eager, compiled, [compiled_trunk,] eager, ...
                for mode, got in runs.items():
                    got.append(step_cpu(adapter, rows, mode != "eager", steps, mode == "compiled_trunk"))
            out["step_cpu_s"][f"{rows} row(s)"] = {m: round(statistics.median(v), 3) for m, v in runs.items()}
    return out


def step_cpu(adapter, rows: int, compiled: bool, steps: int, trunk: bool = False) -> float:
    """CPU seconds of one whole fast denoise step (the trunk and the vocabulary pass) of ``rows``
    rows, the median over ``steps`` denoise-only steps (``trunk``: after as many untimed ones, in
    which its graphs compile)."""
    from tandem_tools.bench.step_driver import Steps

    drive, times = Steps(adapter, rows, compiled=compiled, grow=8, max_tokens=4096, compiled_trunk=trunk), []
    for _ in range(steps if trunk else 0):
        drive.run(drive.full())
    while len(times) < steps:
        batch = drive.full()
        t = time.process_time()
        drive.run(batch)
        times.append(time.process_time() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem_tools.bench.vocab", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="shape-diffusiongemma")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as in a Ray actor)")
    p.add_argument("--no-compile", action="store_true", help="eager and the limit only")
    p.add_argument("--steps", type=int, default=4, help="also time whole denoise steps of the runner, eager vs "
                   "compiled, at 1 and 4 rows: the median of this many steps, two runs each (0: skip)")
    p.add_argument("--trunk", action="store_true", help="with --steps: also the trunk compiled (compiled_trunk)")
    args = p.parse_args(argv)
    result = measure(args.model, args.rounds, args.threads, not args.no_compile, 0 if args.no_compile else args.steps,
                     args.trunk)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
