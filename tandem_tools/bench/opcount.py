"""Aten ops per denoise step of the diffusion runner (issue 36's measure of a step shaped for a
device: every aten op is at least one kernel launch there).

``python -m tandem_tools.bench.opcount [--model shape-diffusiongemma] [--rows 1,4] [--sampler fast]``
admits ``rows`` sequences, runs until each is denoising, then counts the ops of one
denoise-only step under a ``TorchDispatchMode``: in all, per layer, the most frequent, and the
host synchronisations among them (``_local_scalar_dense``: ``.item()``/``.tolist()``;
``nonzero``), which stall a device's queue, and the tensors made from Python numbers in the step
(``lift_fresh``: ``torch.tensor(...)``; on a device each is a copy that waits for the stream: the
step's numbers go through ``diffusion_plugin.step.staging`` instead).

With ``--compiled-trunk`` (``engine_args.compiled_trunk``) the trunk is one compiled graph, whose
work a dispatch mode does not see: its launches are counted from the code inductor generates
(each fused kernel and each extern call: GEMMs, the grouped experts), and the rest of the step
(the vocabulary pass, the sampler) by the dispatch mode, as before.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter

from diffusion_plugin.batcher.memory import DEVICE_CHUNK_ROWS

SYNCS = ("aten._local_scalar_dense", "aten.nonzero", "aten.equal", "aten.is_nonzero")
HOST_TENSOR = "aten.lift_fresh"  # a tensor made from Python numbers (``torch.tensor``)


def count_step(adapter, rows: int, sampler: str = "fast", prompt_len: int = 16, compiled_trunk: bool = False,
               device_form: bool = False) -> dict:
    """One denoise-only step of ``rows`` rows: {"ops", "per_layer", "syncs", "host_tensors", "top"} (and, with
    ``compiled_trunk``, "trunk": the compiled trunk's launches in place of its eager ops; with
    ``device_form``, "parts": so for each compiled part of the step)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    from diffusion_plugin.step.compiled import compile_part, compile_trunk
    from tandem_tools.bench.step_driver import Steps

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: Counter = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    drive = Steps(adapter, rows, sampler, prompt_len=prompt_len, compiled=device_form,
                  compiled_trunk=compiled_trunk or device_form, chunk_rows=DEVICE_CHUNK_ROWS if device_form else 1,
                  batched_vocab=device_form or None)
    batch = drive.full()
    counter = Count()
    parts: dict = {}

    def counted(name: str, eager, compile_):
        """``eager`` run under the count, its ops taken out and its compiled form's launches put in."""
        def call(*args):
            inner = Count()
            with _disable_current_modes(), inner:  # (not in the step's count)
                out = eager(*args)
            launches = compiled_launches(compile_(eager), args)
            parts.setdefault(name, []).append({"eager_ops": sum(inner.ops.values()), **launches})
            return out
        return call

    drive.runner.passes.instrument(lambda name, eager: counted(name, eager,
                                                               compile_trunk if name == "trunk" else compile_part))
    with torch.inference_mode(), counter:
        drive.runner.execute(batch, drive.seqs)
    total = sum(counter.ops.values()) + sum(c["kernels"] + c["extern"] for calls in parts.values() for c in calls)
    layers = len(adapter.layer_types)
    trunk = ({"eager_ops": parts["trunk"][0]["eager_ops"], "launches": {k: parts["trunk"][0][k] for k in
             ("kernels", "extern")}} if "trunk" in parts else None)
    return {"rows": rows, "ops": total, "per_layer": round(total / layers, 1), "layers": layers,
            "syncs": {k: counter.ops[k] for k in SYNCS if counter.ops[k]}, "host_tensors": counter.ops[HOST_TENSOR],
            "top": counter.ops.most_common(12),
            **({"trunk": trunk} if trunk else {}), **({"parts": parts} if device_form else {})}


def compiled_launches(compiled, args) -> dict:
    """The launches of one call of ``compiled`` (a function compiled as the step's parts are:
    ``compiled.compile_trunk``, ``compile_part``), read from the code inductor generates for it (a
    fresh compilation: Dynamo's caches are reset), outside any dispatch mode."""
    import re

    import torch._dynamo
    from torch._inductor.utils import run_and_get_code
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        torch._dynamo.reset()
        _, codes = run_and_get_code(compiled, *args)
    call = codes[-1][codes[-1].index("def call("):]
    return {"kernels": len(re.findall(r"^\s+cpp_fused_\w+\(|^\s+triton_\w+\.run\(", call, re.M)),
            "extern": len(re.findall(r"extern_kernels\.\w+\(|torch\.ops\.\w+\.\w+\.default\(|aten\.\w+\.\w+\(",
                                     call))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem_tools.bench.opcount", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="shape-diffusiongemma", help="a built-in diffusion model or a path")
    p.add_argument("--rows", default="1,4", help="rows per step, comma-separated (default: 1,4)")
    p.add_argument("--sampler", choices=["fast", "exact"], default="fast")
    p.add_argument("--json", action="store_true", help="one JSON line per row count")
    p.add_argument("--compiled-trunk", action="store_true", help="the trunk compiled (engine_args.compiled_trunk): "
                   "its launches counted from inductor's code")
    p.add_argument("--device-form", action="store_true", help="the step as a device engine runs it with "
                   "compiled_vocab and compiled_trunk: the trunk, each chunk's vocabulary pass (chunks of "
                   f"{DEVICE_CHUNK_ROWS} rows), the draws and the acceptance compiled, each one's launches counted "
                   "from inductor's code")
    args = p.parse_args(argv)
    import torch

    from diffusion_plugin.families.diffusiongemma import DiffusionGemmaAdapter
    from workers import tiny_models

    torch.set_num_threads(1)
    path = args.model if "/" in args.model else str(tiny_models.build(args.model))
    adapter = DiffusionGemmaAdapter(path)
    for rows in (int(x) for x in args.rows.split(",")):
        result = count_step(adapter, rows, args.sampler, compiled_trunk=args.compiled_trunk,
                            device_form=args.device_form)
        if args.json:
            print(json.dumps(result))
        else:
            print(f"{args.model}, {args.sampler}, {rows} row(s): {result['ops']:,} aten ops per denoise step, "
                  f"{result['per_layer']:,} per layer ({result['layers']} layers); host syncs {result['syncs']}; "
                  f"tensors made from host numbers {result['host_tensors']}; "
                  f"most frequent {result['top']}"
                  + (f"; compiled trunk {result['trunk']}" if args.compiled_trunk else "")
                  + (f"; compiled parts {result['parts']}" if args.device_form else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
