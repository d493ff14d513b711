"""The fast trunk compiled (``engine_args.compiled_trunk``): the family's whole decoder forward
as ``torch.compile`` (inductor) graphs, one per (lone row or several, context pages, first step
of a block or not); on a device each graph's kernels are the CUDA-graph-ready unit.

The trunk traces as ONE graph: what a pass sets for the family's forward is a ``LocalVar``
(Dynamo cannot trace ``ContextVar.get``), the grouped experts are one opaque op
(``gemm.grouped_mm``), and the eager-only counters are not counted while compiling. The row
count is dynamic (rows 2..max_batch share a graph; a lone row has its own, as its GEMMs are
padded to two); the block tables are padded to a power of two of pages (``kv_view.bucket_width``),
so the graphs of a server's life are a few per size class, not one per context length.

What it gives (``docs/benchmarks.md``, shape-diffusiongemma, one CPU thread): ~34 launches a
layer (30-32 inductor kernels and 36 GEMMs or grouped GEMMs for two layers) against ~320 eager
aten ops; a row's bits do not depend on its batch mates or the table's padding (tested), and
differ from the eager trunk's by ~5e-5. The trunk's CPU is 0.8x eager's, but there the trunk is
a fifth of a step (hidden 128; the vocabulary pass is the rest), so a whole step does not get
cheaper on the CPU. The graphs of a one-page context compile at engine start (``Runner.warm``
rehearses a block of one row and of two); a longer context's compile in the first step that
needs them (4-35 s each on this CPU), and that step waits. Off by default: it is the step's
shape for a device.
"""

from __future__ import annotations

RECOMPILE_LIMIT = 64  # graphs one trunk may compile (size classes); past it an error, never eager


def compile_trunk(forward, cuda_graphs: bool = False):
    """``forward`` (a family's ``decode_hidden``) as a compiled function, under ``RECOMPILE_LIMIT``
    (``_limited``).

    ``cuda_graphs`` (``engine_args.cuda_graphs``, a cuda device): inductor's CUDA graph trees
    (``mode="reduce-overhead"``) capture each graph at its second call and replay it from then on;
    an input not marked static is copied into the graph's buffers at each replay (the KV pool is
    marked: ``mark_static``), and the output is copied out (a replay overwrites its buffers)."""
    import torch

    limited = _limited(torch.compile(forward, dynamic=True, mode="reduce-overhead" if cuda_graphs else None))
    if not cuda_graphs:
        return limited

    def replayed(*args, **kwargs):
        torch.compiler.cudagraph_mark_step_begin()
        return limited(*args, **kwargs).clone()

    return replayed


def compile_part(fn):
    """Another part of the fast step (the batched vocabulary pass, the draws, the acceptance) as
    compiled graphs, rows dynamic as the trunk's: a lone row has its graph, rows 2.. share one.
    Reductions are not split across kernels (``split_reductions``: a split's count follows the
    rows, and with it a row's summation order), and where inductor has it, its batch-invariant mode
    (each kernel's configuration fixed whatever the batch). Under the trunk's recompile limit."""
    import torch
    import torch._inductor.config as inductor

    options = {"split_reductions": False, **({"batch_invariant": True} if hasattr(inductor, "batch_invariant") else {})}
    return _limited(torch.compile(fn, dynamic=True, options=options))


def _limited(compiled):
    """``compiled``'s calls, and only them, under ``RECOMPILE_LIMIT``, failing when it is hit (past
    it Dynamo would otherwise run the eager function, other bits, without a word); the process's
    Dynamo configuration, which other compiled functions read, is left as it is."""
    import torch

    def call(*args, **kwargs):
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True):
            return compiled(*args, **kwargs)

    return call


def mark_static(pool) -> None:
    """The KV pool's tensors (allocated once, read in place by the trunk) as static inputs of the
    CUDA graphs: a replay reads them where they are instead of copying them in."""
    import torch._dynamo

    for t in (*pool.k, *pool.v):
        torch._dynamo.mark_static_address(t)
