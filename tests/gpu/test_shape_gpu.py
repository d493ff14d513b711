"""The shape model (canvas 256, vocabulary 262,144) on a CUDA device, through the batcher
(scheduler + runner + DiffusionGemma adapter), in both samplers:
- exact: each sequence, sharing batches with others that join at other steps, gives exactly the
  tokens HF ``generate()`` gives for it alone on the same device after the same seed;
- fast: batch-invariant (a sequence's tokens do not depend on its batch mates);
- memory: peak device memory grows by <= 1 GiB per row, and nothing stays behind (beyond the
  fast mode's KV page pool, reserved once);
- the fast mode's grouped experts (torch._grouped_mm) are batch-invariant on the device too;
- the compiled trunk under CUDA graphs (``engine_args.cuda_graphs``) replays the compiled step bit
  for bit, and launches at most 60 kernels a layer; the step's device form (``compiled_vocab`` too)
  is batch-invariant and launches at most 60 a layer for the whole step, and a fast step's host
  waits for the device once, at its end (issue 36).
Run on a lent device: ``python -m pytest tests/gpu -q -rs -s`` (prints the memory figures).
"""

import pytest
import torch

from diffusion_plugin.batcher.memory import DEVICE_CHUNK_ROWS
from diffusion_plugin.batcher.request import SamplingParams, Sequence
from diffusion_plugin.batcher.scheduler import Scheduler
from diffusion_plugin.families.diffusiongemma import DiffusionGemmaAdapter
from diffusion_plugin.step.runner import Runner

TEXTS = [
    "Hello there",
    "Tell me about the river and the sea, and the fishermen who mend their nets on the quay.",
    "def add(a, b):",
    "Numbers and dates appear everywhere: 1, 2, 3, 10, 42, 100, 256 " * 4,
]
ARRIVALS = {0: [0, 1], 2: [2], 5: [3]}  # step -> prompts arriving then (they join mid-block of the others)
STEPS = 4  # denoise steps per block
MAX_TOKENS = 300  # two blocks of 256 (a commit pass), truncated
GIB = 1 << 30
DEVICE = "cuda"
KV_BUDGET = 4 * GIB  # the fast mode's page pool is reserved at once on a device


@pytest.fixture(scope="module")
def adapter(shape_path):
    return DiffusionGemmaAdapter(shape_path, device=DEVICE)


@pytest.fixture(scope="module")
def prompts(adapter):
    return [adapter.tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False) for t in TEXTS]


def _run(adapter, sampler: str, prompts: list, arrivals: dict, knobs: dict, max_batch: int = 4,
         max_tokens: int = MAX_TOKENS, seed0: int = 100, rowwise: bool = False, **compiled) -> tuple[dict, int, Runner]:
    """Drive scheduler + runner like the engine's loop; returns (outputs by prompt index, widest
    batch, runner). ``compiled``: the Runner's ``compiled_trunk`` and ``cuda_graphs``."""
    params = {**adapter.defaults(), "max_denoising_steps": STEPS, **knobs}
    sched = Scheduler(max_batch=max_batch, canvas_length=adapter.canvas_length)
    runner = Runner(adapter, sampler=sampler, kv_budget_bytes=KV_BUDGET, rowwise=rowwise, **compiled)
    seqs, widest, step = {}, 0, 0
    while step <= max(arrivals) or sched.has_work():
        for i in arrivals.get(step, []):
            seq = Sequence(seq_id=f"s{i}", prompt_ids=prompts[i], params=SamplingParams(
                max_tokens=max_tokens, seed=seed0 + i, eos_token_ids=adapter.eos_token_ids, **params))
            seqs[seq.seq_id] = seq
            sched.add(seq)
        batch, _ = sched.schedule()
        widest = max(widest, len(batch.denoise))
        if not batch.empty():
            sched.update(runner.execute(batch, seqs))
        step += 1
    return {int(k[1:]): s.output_ids for k, s in seqs.items()}, widest, runner


def _reference(path: str, prompt: list[int], seed: int, knobs: dict, eos: tuple[int, ...],
               max_tokens: int = MAX_TOKENS) -> list[int]:
    from transformers import DiffusionGemmaForBlockDiffusion

    model = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=torch.float32).to(DEVICE).eval()
    torch.manual_seed(seed)  # seeds the CUDA generator generate() draws from
    out = model.generate(torch.tensor([prompt], device=DEVICE), max_new_tokens=max_tokens,
                         max_denoising_steps=STEPS, **knobs).sequences[0, len(prompt):].tolist()
    cut = next((i for i, t in enumerate(out) if t in eos), None)
    return (out[:cut] if cut is not None else out)[:max_tokens]


@pytest.mark.parametrize("knobs", [{}, {"t_min": 0.01, "t_max": 0.02}], ids=["default", "near-greedy"])
def test_exact_equals_hf_generate_alone_on_gpu(adapter, prompts, shape_path, knobs):
    outputs, widest, _ = _run(adapter, "exact", prompts, ARRIVALS, knobs)
    assert widest >= 3, "the sequences must share batched forwards"
    for i, prompt in enumerate(prompts):
        want = _reference(shape_path, prompt, 100 + i, knobs, adapter.eos_token_ids)
        assert outputs[i] == want, f"prompt {i} ({len(prompt)} tokens) differs from HF generate() on the GPU"


@pytest.mark.parametrize("rowwise", [False, True], ids=["batched", "rowwise"])
def test_fast_is_batch_invariant_on_gpu(adapter, prompts, rowwise):
    together, widest, _ = _run(adapter, "fast", prompts, ARRIVALS, {}, rowwise=rowwise)
    assert widest >= 3
    for i in (0, 3):  # the first arrival, and the last (it joins a batch already mid-block)
        alone, _, _ = _run(adapter, "fast", prompts, {0: [i]}, {}, rowwise=rowwise)
        assert alone[i] == together[i], f"prompt {i}: its fast-mode tokens depend on its batch mates"
        assert len(alone[i]) == MAX_TOKENS


def test_a_cuda_graph_replay_equals_the_compiled_step_on_gpu(adapter, prompts):
    """``engine_args.cuda_graphs``: the compiled trunk captured as CUDA graphs (one per row count
    and size class) and replayed gives every row the same tokens as the same compiled graphs run
    without capture (the same kernels), with rows joining mid-block; and a row's tokens alone
    equal its tokens among mates."""
    graphs, widest, _ = _run(adapter, "fast", prompts, ARRIVALS, {}, compiled_trunk=True, cuda_graphs=True)
    plain, _, _ = _run(adapter, "fast", prompts, ARRIVALS, {}, compiled_trunk=True)
    assert widest >= 3
    assert graphs == plain, "a CUDA graph replay differs from the compiled step it captured"
    alone, _, _ = _run(adapter, "fast", prompts, {0: [3]}, {}, compiled_trunk=True, cuda_graphs=True)
    assert alone[3] == graphs[3], "under CUDA graphs a row's tokens depend on its batch mates"


def test_the_device_form_is_batch_invariant_on_gpu(adapter, prompts):
    """The step's device form (``compiled_vocab`` on a cuda device: each chunk's vocabulary pass,
    the draws and the acceptance compiled; the trunk compiled under CUDA graphs; a device engine's chunks):
    a row's tokens alone equal its tokens among mates joining mid-block."""
    form = {"compiled_trunk": True, "cuda_graphs": True, "compiled_vocab": True, "chunk_rows": DEVICE_CHUNK_ROWS}
    together, widest, _ = _run(adapter, "fast", prompts, ARRIVALS, {}, **form)
    assert widest >= 3
    for i in (0, 3):
        alone, _, _ = _run(adapter, "fast", prompts, {0: [i]}, {}, **form)
        assert alone[i] == together[i], f"prompt {i}: in the device form its tokens depend on its batch mates"
        assert len(alone[i]) == MAX_TOKENS


@pytest.mark.parametrize("rows", [1, 4])
def test_the_device_form_launches_at_most_60_a_layer_on_gpu(adapter, rows):
    """Issue 36's count for a whole step on the device, in its device form: the compiled parts'
    launches (read from inductor's code) and every other aten op, per layer, at 1 and 4 rows."""
    from tandem_tools.bench.opcount import count_step

    result = count_step(adapter, rows, "fast", device_form=True)
    print(f"\nwhole step, device form, on {DEVICE}, {rows} row(s): {result['ops']} ({result['per_layer']} a layer); "
          f"parts {result['parts']}")
    assert result["per_layer"] <= 60 and not result["syncs"] and not result["host_tensors"], result


@pytest.mark.parametrize("form", ["eager", "device"])
def test_a_fast_step_waits_for_the_device_once_on_gpu(adapter, form):
    """The host waits for the device once a step, at its end (the decisions' one transfer; a
    commit alone: never): in a denoise-only step and in the steps around a block's commit,
    counted by CUDA's sync debug mode. A copy made with ``torch.tensor(..., device=cuda)``
    between the step's kernels (which waits for the stream) fails it; the step's numbers go
    through ``staging``."""
    import warnings

    from torch._dynamo.utils import counters

    from tandem_tools.bench.step_driver import Steps

    device_form = form == "device"
    # Four blocks: contexts of 1, 3, 5 and 7 pages (tables of 1, 4, 8, 8), so the third commit's
    # step runs graphs compiled before it; a step that compiles (a longer context's first) is not
    # counted, as compiling may wait on the device.
    drive = Steps(adapter, 2, "fast", compiled=device_form, compiled_trunk=device_form,
                  chunk_rows=DEVICE_CHUNK_ROWS if device_form else 1, batched_vocab=device_form or None,
                  max_tokens=4 * adapter.canvas_length)
    waits, steps = [], 0
    while drive.sched.has_work() and steps < 400:
        batch, _ = drive.sched.schedule()
        if batch.empty():
            continue
        torch.cuda.synchronize()
        graphs = counters["stats"]["unique_graphs"]
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                drive.run(batch)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        steps += 1
        compiled = counters["stats"]["unique_graphs"] != graphs
        if not batch.admit and not compiled:  # (an admission copies its prompt's ids before the first kernel)
            kind = ("commit+" if batch.encode else "") + ("denoise" if batch.denoise else "")
            waits.append((kind, sum("synchronizing" in str(w.message) for w in seen)))
    print(f"\nfast, {form} form: (step, host waits) {sorted(set(waits))} over {len(waits)} steps")
    assert {kind for kind, _ in waits} >= {"denoise", "commit+denoise"}, waits
    assert all(n == int(kind.endswith("denoise")) for kind, n in waits), sorted(set(waits))


@pytest.mark.parametrize("rows", [1, 4])
def test_the_compiled_trunk_launches_at_most_60_kernels_a_layer_on_gpu(adapter, rows):
    """Issue 36's count on the device: the compiled trunk's launches (triton kernels and GEMM or
    grouped-GEMM calls, read from inductor's code) per layer, at 1 and 4 rows; no host sync in the
    step (``tandem_tools.bench.opcount``)."""
    from tandem_tools.bench.opcount import count_step

    result = count_step(adapter, rows, "fast", compiled_trunk=True)
    launches = result["trunk"]["launches"]
    per_layer = (launches["kernels"] + launches["extern"]) / result["layers"]
    print(f"\ncompiled trunk on {DEVICE}, {rows} row(s): {launches} = {per_layer:.1f} a layer; whole step "
          f"{result['ops']} ({result['per_layer']} a layer)")
    assert launches["kernels"] > 0 and per_layer <= 60, result
    assert not result["syncs"] and not result["host_tensors"], result


@pytest.mark.parametrize("sampler", ["exact", "fast"])
def test_memory_per_row_on_gpu(adapter, prompts, sampler):
    """Peak device memory of one block at 1 and at 4 rows (all admitted at once): <= 1 GiB per extra
    row; held state between steps (beyond KV) a few MB per row; nothing left once they finish."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    peaks = {}
    for rows in (1, 4):
        torch.cuda.reset_peak_memory_stats()
        _, widest, runner = _run(adapter, sampler, prompts, {0: list(range(rows))}, {}, max_tokens=256)
        assert widest == rows
        torch.cuda.synchronize()
        peaks[rows] = torch.cuda.max_memory_allocated() - base
        pool = 0 if runner.pool is None else sum(t.numel() * t.element_size() for t in (*runner.pool.k, *runner.pool.v))
        scratch = sum(t.numel() * t.element_size() for t in runner.passes.scratch._bufs or ())  # fixed, reused
        left = torch.cuda.memory_allocated() - base - pool - scratch
        assert left < 64 << 20, f"{left / 2**20:.0f} MiB still allocated after every sequence finished"
        runner = None  # its pool goes before the next run reserves one
    per_row = (peaks[4] - peaks[1]) / 3
    print(f"\n{sampler}: device peak {peaks[1] / GIB:.2f} GiB at 1 row, {peaks[4] / GIB:.2f} GiB at 4 rows, "
          f"{per_row / GIB:.3f} GiB per extra row")
    assert per_row <= GIB, f"{sampler}: peak grows by {per_row / GIB:.2f} GiB per row (target <= 1 GiB)"


@pytest.mark.parametrize("hidden,inter,experts,top_k", [(128, 64, 128, 8), (2816, 704, 8, 4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_experts_are_batch_invariant_on_gpu(hidden, inter, experts, top_k, dtype):
    """``torch._grouped_mm`` gives each group's rows the same bits whatever the other groups and
    its own row count (bf16: CUTLASS's grouped kernel on sm90+; float32: torch's per-group
    fallback), and the result stays close to HF's experts."""
    from diffusion_plugin.families.diffusiongemma_moe import grouped_experts
    from tests.experts_cases import experts_case as _experts_case
    from tests.experts_cases import routed_tokens as _tokens

    module = _experts_case(hidden, inter, experts, top_k).to(DEVICE, dtype)
    args = (module.gate_up_proj, module.down_proj, module.act_fn)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    on = lambda ts: [ts[0].to(DEVICE, dtype), ts[1].to(DEVICE), ts[2].to(DEVICE, dtype)]  # noqa: E731
    with torch.no_grad():
        for seed in range(3):
            row = on(_tokens(256, hidden, experts, top_k, seed))
            alone = grouped_experts(*args, *row)
            hf = module(*row)
            assert torch.allclose(alone.float(), hf.float(), rtol=tol, atol=tol * float(hf.abs().max()))
            for mates in ([1], [100], [256] * 3, [5] + [256] * 15):
                rows = [on(_tokens(n, hidden, experts, top_k, 100 * seed + j)) for j, n in enumerate(mates)]
                rows.insert(1, row)
                out = grouped_experts(*args, *(torch.cat(parts) for parts in zip(*rows, strict=True)))
                first = rows[0][0].shape[0]
                assert torch.equal(out[first:first + 256], alone), f"seed {seed}, mates {mates}, {dtype}"


def test_prefix_cache_hits_equal_their_misses_on_gpu(adapter):
    """Fast mode with the prefix cache: rows sharing 1-2 pages of a prompt, joining while others
    run, give exactly the tokens each gives alone on an empty cache (a hit never changes a response)."""
    import random

    from diffusion_plugin.batcher.memory import PAGE_TOKENS

    rng, vocab = random.Random(3), adapter.vocab_size
    ids = lambda n: [rng.randrange(vocab // 8, vocab - vocab // 8) for _ in range(n)]  # noqa: E731
    system = ids(2 * PAGE_TOKENS + 40)
    prompts = [system[:PAGE_TOKENS + rng.randint(1, PAGE_TOKENS + 40)] + ids(rng.randint(1, 20)) for _ in range(4)]
    arrivals = {0: [0], 1: [1], 3: [2, 3]}

    def run(which: dict) -> tuple[dict, dict]:
        params = {**adapter.defaults(), "max_denoising_steps": STEPS}
        sched = Scheduler(max_batch=4, canvas_length=adapter.canvas_length)
        runner = Runner(adapter, sampler="fast", kv_budget_bytes=KV_BUDGET, prefix_cache=True)
        seqs, step = {}, 0
        while step <= max(which) or sched.has_work():
            for i in which.get(step, []):
                seq = Sequence(seq_id=f"s{i}", prompt_ids=prompts[i], params=SamplingParams(
                    max_tokens=64, seed=50 + i, eos_token_ids=(), **params))
                seqs[seq.seq_id] = seq
                sched.add(seq)
            batch, _ = sched.schedule()
            if not batch.empty():
                sched.update(runner.execute(batch, seqs))
            else:
                for seq_id in batch.free:
                    runner.free(seq_id)
            step += 1
        return ({int(k[1:]): s.output_ids for k, s in seqs.items()},
                {int(k[1:]): s.cached_tokens for k, s in seqs.items()})

    together, cached = run(arrivals)
    assert sum(c > 0 for c in cached.values()) >= 2, f"some rows must hit: {cached}"
    for i in range(len(prompts)):
        alone, none = run({0: [i]})
        assert none[i] == 0
        assert alone[i] == together[i], f"row {i} (cached {cached[i]} tokens) differs from its miss"
