"""`python -m tandem_tools.bench.grammar`: what a grammar costs a diffusion row, at the real shape.

The diffusion runner in this process (one engine alive at a time, one torch thread as in a Ray
actor), on ``shape-diffusiongemma`` (DiffusionGemma's canvas, 256, and vocabulary, 262,144): the
same requests with and without a JSON schema, for each sampler and concurrency, in interleaved
rounds. The schema is compiled against a synthetic 262,144-entry vocabulary (``synthetic_vocab``:
the built-in tokenizer has 1,027 real entries, and xgrammar's mask fills cost by the entries it
must check), so the mask fills, the bitmask over the canvas x vocabulary logits and the refused
draws all run at the released model's size. A constrained row's output is checked: the synthetic
strings of its tokens parse as JSON and validate against the schema.

Reported per setup: seconds per batched denoise step, CPU seconds per row-step (this process's
CPU time over rows x steps: the figure the box reproduces best), CPU ms per committed token, and
the ratios constrained / unconstrained. Rows under a schema stop when the schema's JSON ends.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "city": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["person", "company", "place"]},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 1000}, "maxItems": 12},
        "active": {"type": "boolean"},
        "note": {"type": "string", "maxLength": 80},
    },
    "required": ["name", "city", "age", "kind", "scores", "active", "note"],
    "additionalProperties": False,
}
LETTERS = "abcdefghijklmnopqrstuvwxyz"
PUNCT = list('{}[]:,"0123456789 .-_\\/\n\t') + ["true", "false", "null", '":', '",', '": "', "\n  "]


def synthetic_vocab(size: int, eos: int, seed: int = 0) -> list[str]:
    """``size`` token strings shaped like a large subword vocabulary: 16 reserved ids (the model's
    special tokens: ``eos`` among them), JSON's punctuation and digits, then lowercase pieces of
    1-10 letters, half with a leading space, some capitalised."""
    rng = random.Random(seed)
    vocab = [f"<reserved_{i}>" for i in range(16)] + list(PUNCT)  # the model's special ids come first
    while len(vocab) < size:
        piece = "".join(rng.choice(LETTERS) for _ in range(rng.randint(1, 10)))
        if rng.random() < 0.2:
            piece = piece.capitalize()
        vocab.append((" " if rng.random() < 0.5 else "") + piece)
    vocab = vocab[:size]
    vocab[eos] = "<eos>"
    return vocab


def compile_schema(vocab: list[str], eos: int):
    """The schema compiled as the engine compiles one (``GrammarCompiler``), over ``vocab``."""
    import xgrammar as xgr

    from diffusion_plugin.step.grammar import GrammarCompiler

    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=[eos])
    compiler = GrammarCompiler(None, len(vocab), (eos,), info=info)
    t0 = time.perf_counter()
    grammar = compiler.compile("json", json.dumps(SCHEMA))
    return grammar, time.perf_counter() - t0


def run_setup(adapter, sampler: str, c: int, grammar, args, vocab: list[str]) -> dict:
    """``c`` sequences to the end (each ``max_tokens`` or the schema's end); timings and checks."""
    import jsonschema

    from diffusion_plugin.batcher.request import SamplingParams, Sequence
    from diffusion_plugin.batcher.scheduler import Scheduler
    from diffusion_plugin.step.runner import Runner

    sched = Scheduler(max_batch=c, canvas_length=adapter.canvas_length, row_boundaries=False)
    runner, seqs = Runner(adapter, sampler, chunk_rows=1), {}
    for i in range(c):
        params = SamplingParams(max_tokens=args.max_tokens, seed=11 + i, eos_token_ids=adapter.eos_token_ids,
                                **{**adapter.defaults(), "max_denoising_steps": args.steps})
        prompt = [(7 * i + 13 * j) % 1000 + 6 for j in range(24 + 16 * i)]
        seq = Sequence(seq_id=f"s{i}", prompt_ids=prompt, params=params, grammar=grammar)
        seqs[seq.seq_id] = seq
        sched.add(seq)
    from tandem_tools.bench.sampling import drive

    timing = drive(sched, runner, seqs)
    valid = None
    if grammar is not None:
        valid = 0
        for s in seqs.values():
            text = "".join(vocab[t] for t in s.output_ids if t not in adapter.eos_token_ids)
            try:
                jsonschema.validate(json.loads(text), SCHEMA)
                valid += 1
            except (ValueError, jsonschema.ValidationError) as e:
                print(f"  INVALID ({e}): {text[:200]!r}", flush=True)
    return {**timing, "cpu_ms_per_token": 1000 * timing["cpu_s"] / max(timing["tokens"], 1), "valid": valid}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="shape-diffusiongemma", help="built-in model (default: shape-diffusiongemma)")
    p.add_argument("--samplers", default="fast,exact", help="samplers (default: fast,exact)")
    p.add_argument("--concurrency", default="1,4", help="sequences per batch (default: 1,4)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default: 2)")
    p.add_argument("--max-tokens", type=int, default=256, help="max_tokens per sequence (default: 256)")
    p.add_argument("--steps", type=int, default=8, help="max_denoising_steps (default: 8)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)

    import torch

    from diffusion_plugin.families import load_adapter
    from workers import tiny_models

    torch.set_num_threads(1)
    adapter = load_adapter("diffusiongemma", str(tiny_models.build(args.model)))
    eos = adapter.eos_token_ids[0]
    vocab = synthetic_vocab(adapter.vocab_size, eos)
    grammar, compile_s = compile_schema(vocab, eos)
    print(f"{args.model}: canvas {adapter.canvas_length}, vocabulary {adapter.vocab_size}; schema compiled in "
          f"{compile_s:.2f} s against a synthetic {len(vocab)}-entry vocabulary", flush=True)
    setups = [(s, int(c), g) for s in args.samplers.split(",") for c in args.concurrency.split(",")
              for g in (False, True)]
    results: dict[tuple, list[dict]] = {k: [] for k in setups}
    for rnd in range(args.rounds):
        order = setups if rnd % 2 == 0 else list(reversed(setups))
        for sampler, c, constrained in order:
            r = run_setup(adapter, sampler, c, grammar if constrained else None, args, vocab)
            results[(sampler, c, constrained)].append(r)
            print(f"round {rnd} {sampler} c={c} {'schema' if constrained else 'free  '}: "
                  f"{r['s_per_step']:.3f} s/step, {r['cpu_s_per_row_step']:.3f} CPU s/row-step, "
                  f"{r['cpu_ms_per_token']:.1f} CPU ms/token, {r['tokens']} tokens, {r['steps']} steps"
                  + ("" if r["valid"] is None else f", valid {r['valid']}/{c}"), flush=True)
    rev = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True).stdout.strip()
    print(f"\nmedians of {args.rounds} rounds (commit {rev}); ratio = schema / free")
    print("| sampler | c | s/step free | s/step schema | ratio | CPU s/row-step free | schema | ratio "
          "| CPU ms/token free | schema | valid |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    table = []
    for sampler in args.samplers.split(","):
        for c in (int(x) for x in args.concurrency.split(",")):
            free, con = results[(sampler, c, False)], results[(sampler, c, True)]

            def med(rs, key):
                return statistics.median(r[key] for r in rs)

            row = {"sampler": sampler, "c": c, **{f"{k}_{n}": med(rs, k) for n, rs in (("free", free), ("schema", con))
                                                  for k in ("s_per_step", "cpu_s_per_row_step", "cpu_ms_per_token")},
                   "valid": f"{sum(r['valid'] for r in con)}/{c * len(con)}"}
            table.append(row)
            print(f"| {sampler} | {c} | {row['s_per_step_free']:.3f} | {row['s_per_step_schema']:.3f} | "
                  f"{row['s_per_step_schema'] / row['s_per_step_free']:.2f}x | {row['cpu_s_per_row_step_free']:.3f} | "
                  f"{row['cpu_s_per_row_step_schema']:.3f} | "
                  f"{row['cpu_s_per_row_step_schema'] / row['cpu_s_per_row_step_free']:.2f}x | "
                  f"{row['cpu_ms_per_token_free']:.1f} | {row['cpu_ms_per_token_schema']:.1f} | {row['valid']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"commit": rev, "compile_s": compile_s, "rows": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
