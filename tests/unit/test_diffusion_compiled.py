"""The fast trunk compiled (``engine_args.compiled_trunk``, ``diffusion_plugin.step.compiled``) on
the tiny model: the family's decoder forward traces as one graph, a row's tokens do not depend on
its batch mates or on its block table's padding, and the hidden states stay close to the eager
trunk's."""

import pytest
import torch

from diffusion_plugin.families.diffusiongemma import DiffusionGemmaAdapter
from diffusion_plugin.step import attention, gemm
from diffusion_plugin.step.compiled import compile_trunk
from diffusion_plugin.step.kv_view import bucket_width
from tandem_tools.bench.step_driver import Steps
from tests.fast_runs import run as _run
from workers import tiny_models

# Prompts 25, 40 and 90 tokens long, joining mid-run: rows of one and two KV pages (128 tokens)
# in one batch, so a row's table is padded past its own pages (a power of two: ``bucket_width``).
ARRIVALS = {0: [0, 1], 3: [2]}


@pytest.fixture(scope="module")
def adapter():
    torch.set_num_threads(1)
    return DiffusionGemmaAdapter(str(tiny_models.build(tiny_models.TINY_DIFFUSIONGEMMA)))


def _captured(adapter, rows: int, grow: int = 0):
    """A fast step's trunk inputs (``rows`` rows, prompts ``16 + grow * i`` tokens) and the view
    and spec the trunk reads: what ``FastPasses._trunk`` passes to the family's forward."""
    drive = Steps(adapter, rows, "fast", grow=grow)
    batch, seen = drive.full(), {}
    drive.runner.passes._decode = lambda canvas, view, positions, soft: seen.update(
        canvas=canvas, view=view, positions=positions, soft=soft) or adapter.decode_hidden(canvas, view, positions,
                                                                                             soft)
    with torch.inference_mode():
        drive.runner.execute(batch, drive.seqs)
    live = [drive.runner.rows[s] for s in batch.denoise]
    _, spec = drive.runner.passes.views.get([r.seq.seq_id for r in live], [r.version for r in live],
                                            [r.cache for r in live])
    return seen, spec


def test_table_widths_are_padded_to_a_power_of_two():
    assert [bucket_width(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]


def test_the_trunk_recompile_limit_is_its_own_and_fails_loudly(monkeypatch):
    """``compile_trunk`` leaves the process's Dynamo configuration (which the compiled vocabulary
    pass and any other compiled function read) as it was, and past its own limit it raises rather
    than running eager code."""
    import torch._dynamo

    from diffusion_plugin.step import compiled

    before = (torch._dynamo.config.recompile_limit, torch._dynamo.config.fail_on_recompile_limit_hit)
    monkeypatch.setattr(compiled, "RECOMPILE_LIMIT", 1)
    trunk = compile_trunk(lambda x: x * 2 + 1)
    assert torch.equal(trunk(torch.ones(3)), torch.full((3,), 3.0))
    assert (torch._dynamo.config.recompile_limit, torch._dynamo.config.fail_on_recompile_limit_hit) == before
    with pytest.raises(Exception, match="(?i)recompile"):
        trunk(torch.ones(3, dtype=torch.float64))  # another dtype: a second graph, past the limit of one
    torch._dynamo.reset()


def test_the_fast_trunk_traces_as_one_graph(adapter):
    """Nothing in the forward breaks the graph (a ``ContextVar`` read, a float32 grouped GEMM's
    meta function, an eager-only counter each did)."""
    import torch._dynamo

    seen, spec = _captured(adapter, 1)
    token = attention.FAST.set(spec)
    try:
        with torch.inference_mode(), adapter.fast_experts(True), gemm.rows(adapter.canvas_length):
            explained = torch._dynamo.explain(adapter.decode_hidden)(seen["canvas"], seen["view"], seen["positions"],
                                                                     seen["soft"])
    finally:
        attention.FAST.reset(token)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_the_compiled_trunk_is_batch_invariant_and_close_to_eager(adapter):
    together, _, widths = _run(adapter, ARRIVALS, trunk=True, steps=8)
    assert max(widths) == 3
    for i in (0, 2):
        alone, _, _ = _run(adapter, {0: [i]}, trunk=True, steps=8)
        assert alone[f"s{i}"] == together[f"s{i}"], f"row {i} depends on its batch mates"
    assert len({tuple(v) for v in together.values()}) == 3
    # the same inputs through both trunks: close, not equal (inductor fuses and rounds otherwise)
    seen, spec = _captured(adapter, 2, grow=150)
    token = attention.FAST.set(spec)
    try:
        with torch.inference_mode(), adapter.fast_experts(True), gemm.rows(adapter.canvas_length):
            eager = adapter.decode_hidden(seen["canvas"], seen["view"], seen["positions"], seen["soft"])
            compiled = compile_trunk(adapter.decode_hidden)(seen["canvas"], seen["view"], seen["positions"],
                                                            seen["soft"])
    finally:
        attention.FAST.reset(token)
    assert torch.allclose(eager, compiled, atol=1e-3, rtol=1e-3), (eager - compiled).abs().max()


def test_the_cuda_graphs_wiring_runs_on_the_host_and_changes_no_token(adapter):
    """``cuda_graphs`` (a device's option: tests/gpu checks the replays) on the host, where
    inductor skips the capture: its wiring (the reduce-overhead compile, the step marks, the copied
    output, the KV pool marked static) serves, and a row's tokens are the compiled trunk's."""
    graphs, _, widths = _run(adapter, {0: [0, 1]}, trunk=True, steps=4, max_tokens=40, cuda_graphs=True)
    plain, _, _ = _run(adapter, {0: [0, 1]}, trunk=True, steps=4, max_tokens=40)
    assert max(widths) == 2 and graphs == plain
