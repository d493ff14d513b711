"""The fast sampler on the tiny model: batch invariance, one attention call per layer, experts
without a per-row loop (fixed-shape expert GEMMs), KV read in place from a page pool."""

import pytest
import torch

from diffusion_plugin.batcher.request import SamplingParams, Sequence
from diffusion_plugin.batcher.scheduler import Scheduler
from diffusion_plugin.families import diffusiongemma_moe as moe
from diffusion_plugin.families.diffusiongemma import DiffusionGemmaAdapter
from diffusion_plugin.step import attention, kv_view
from diffusion_plugin.step.runner import Runner
from tests.experts_cases import experts_case as _experts_case
from tests.experts_cases import routed_tokens as _tokens
from tests.fast_runs import ARRIVALS, LONG_ARRIVALS
from tests.fast_runs import run as _run
from workers import tiny_models


@pytest.fixture(scope="module")
def adapter():
    torch.set_num_threads(1)
    return DiffusionGemmaAdapter(str(tiny_models.build(tiny_models.TINY_DIFFUSIONGEMMA)))


@pytest.mark.parametrize("rowwise", [False, True], ids=["batched", "rowwise"])
@pytest.mark.parametrize("row_boundaries", [False, True], ids=["block", "row"])
def test_fast_mode_is_batch_invariant(adapter, row_boundaries, rowwise):
    """Default temperatures (sampling matters), prompts of different lengths joining mid-run. The
    batched trunk (the default) and ``rowwise`` passes give a row the same tokens alone and
    batched, and so the same tokens as each other."""
    together, _, widths = _run(adapter, ARRIVALS, row_boundaries=row_boundaries, rowwise=rowwise)
    assert max(widths) == 4
    for i in range(6):
        alone, _, _ = _run(adapter, {0: [i]}, row_boundaries=row_boundaries, rowwise=not rowwise)
        assert alone[f"s{i}"] == together[f"s{i}"], f"row {i} depends on its batch mates"
    assert len({tuple(v) for v in together.values()}) == 6  # and the rows differ


def test_fast_mode_is_batch_invariant_over_several_kv_pages(adapter):
    """Long prompts: rows read several pages (and a sliding layer gives pages back) beside rows of one."""
    together, _, widths = _run(adapter, LONG_ARRIVALS, max_tokens=300, steps=6)
    assert max(widths) == 4
    for i in (6, 0, 7, 2):
        alone, _, _ = _run(adapter, {0: [i]}, max_tokens=300, steps=6)
        assert alone[f"s{i}"] == together[f"s{i}"], f"row {i} depends on its batch mates"


def test_fast_mode_makes_one_attention_call_per_layer_per_step(adapter):
    """The batched trunk (the default): one attention call per layer; ``rowwise``: one per row."""
    _, calls, widths = _run(adapter, {0: [0, 1, 2, 3]}, steps=4, rowwise=False)
    layers = len(adapter.layer_types)
    assert max(widths) == 4 and all(c <= layers for c in calls)
    _, calls, widths = _run(adapter, {0: [0, 1, 2, 3]}, steps=4, rowwise=True)
    assert calls == [w * layers for w in widths]
    _, calls, widths = _run(adapter, {0: [0, 1, 2, 3]}, sampler="exact", steps=2)
    assert calls == [w * layers for w in widths]  # exact mode: one kernel per row and layer


def test_the_compiled_vocabulary_pass_is_batch_invariant(adapter):
    """``compiled_vocab`` (the pass blocked over the vocabulary, one row at a time): a row's
    tokens are the same alone and among batch mates (chunks of 3 rows and of 1), and the rows
    differ."""
    together, _, widths = _run(adapter, ARRIVALS, compiled=True)
    assert max(widths) == 4
    for i in range(6):
        alone, _, _ = _run(adapter, {0: [i]}, compiled=True)
        assert alone[f"s{i}"] == together[f"s{i}"], f"row {i} depends on its batch mates"
    assert len({tuple(v) for v in together.values()}) == 6


@pytest.mark.parametrize("block", [8192, 256], ids=["one-block", "blocks-and-a-tail"])
def test_the_compiled_vocabulary_passes_match_the_eager_one(adapter, caplog, monkeypatch, block):
    """The same math as the eager passes (their exp and tanh round differently in the last bits):
    the pass blocked over the vocabulary (rows without top logprobs: ``block`` ids a block, the
    tiny vocabulary of 1,039 in one block, or in four and a tail), and the fused one (a row with
    top logprobs in the chunk). A compiled pass that fails hands over for good, with a log line:
    the blocked one to the fused one, that to the eager passes."""
    from diffusion_plugin.families import diffusiongemma_blocked as blocked
    from diffusion_plugin.families import diffusiongemma_vocab as vocab

    monkeypatch.setattr(blocked, "VOCAB_BLOCK", block)
    model, C, H = adapter.model, adapter.canvas_length, adapter.model.lm_head.weight.shape[1]
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, C, H, generator=g) * 4
    inv_t, uniform = torch.tensor([1.0, 1 / 0.4, 1 / 0.8]), torch.rand(3, C, generator=g, dtype=torch.float64)

    def close(a, b):
        for name, x, y in zip(("sampled", "argmax"), a[:2], b[:2], strict=True):
            assert float((x == y).float().mean()) >= 0.99, name
        assert torch.allclose(a[2], b[2], atol=1e-4) and torch.allclose(a[3], b[3], rtol=1e-4, atol=1e-4)

    def fail(*_):
        raise RuntimeError("no compiler")

    with torch.no_grad():
        eager = vocab.fast_chunk(model, hidden, inv_t, uniform, vocab.Scratch())
        scratch = vocab.Scratch(compiled=True)
        scratch.fused = fail  # the blocked pass serves rows without top logprobs: never called
        close(eager, vocab.fast_chunk(model, hidden, inv_t, uniform, scratch))
        fused = vocab.fast_chunk(model, hidden, inv_t, uniform, vocab.Scratch(compiled=True), ks=[2, None, None])
        close(eager, fused)
        assert fused[4][0] is not None and fused[4][0][1].shape == (C, 2)  # top logprobs still served
        broken = vocab.Scratch(compiled=True)
        broken.plain.math = fail
        close(eager, vocab.fast_chunk(model, hidden, inv_t, uniform, broken))  # the fused pass, from now on
        assert broken.plain is None and "blocked vocabulary pass failed" in caplog.text
        broken.fused = fail
        fallback = vocab.fast_chunk(model, hidden, inv_t, uniform, broken)
    assert broken.fused is None and "eager passes serve" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(eager[:4], fallback[:4], strict=True))


def test_the_batched_pass_is_the_eager_maths_and_batch_invariant(adapter, caplog):
    """A device's plain pass (``Scratch(compiled=True, batched=True)``: a chunk in one compiled
    graph) against the eager passes on the same inputs, and a row's bits alone, among two mates
    and among other ones (the graph of one row and the rows' shared one); a failure hands over
    to the other passes, logged."""
    from diffusion_plugin.families import diffusiongemma_vocab as vocab

    model, C, H = adapter.model, adapter.canvas_length, adapter.model.lm_head.weight.shape[1]
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(4, C, H, generator=g) * 4
    inv_t, uniform = torch.tensor([1.0, 1 / 0.4, 1 / 0.8, 1 / 0.6]), torch.rand(4, C, generator=g, dtype=torch.float64)
    with torch.no_grad():
        eager = vocab.fast_chunk(model, hidden[:3], inv_t[:3], uniform[:3], vocab.Scratch())
        scratch = vocab.Scratch(compiled=True, batched=True)
        scratch.fused = None  # never needed by plain rows
        out = vocab.fast_chunk(model, hidden[:3], inv_t[:3], uniform[:3], scratch)
        assert torch.equal(out[1], eager[1])
        assert float((out[0] == eager[0]).float().mean()) >= 0.99
        assert torch.allclose(out[2], eager[2], atol=1e-4) and torch.allclose(out[3], eager[3], rtol=1e-4, atol=1e-4)
        alone = vocab.fast_chunk(model, hidden[:1], inv_t[:1], uniform[:1], scratch)
        others = vocab.fast_chunk(model, hidden[[0, 3]], inv_t[[0, 3]], uniform[[0, 3]], scratch)
        for a, b, c in zip(alone[:4], out[:4], others[:4], strict=True):
            assert torch.equal(a[0], b[0]) and torch.equal(a[0], c[0]), "a row's bits depend on its mates"
        scratch.plain.fn = lambda *_: (_ for _ in ()).throw(RuntimeError("no compiler"))
        fallback = vocab.fast_chunk(model, hidden[:3], inv_t[:3], uniform[:3], scratch)
    assert scratch.plain is None and "batched vocabulary pass failed" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(eager[:4], fallback[:4], strict=True))


def test_fast_draws_depend_only_on_seed_and_step(adapter):
    from diffusion_plugin.step.draws import hash_draws, hash_uniform

    seeds, counters = torch.tensor([1, 2, 1]), torch.tensor([5, 5, 5])
    d = hash_draws(seeds, counters, 8, 2)
    assert torch.equal(d[0], d[2]) and not torch.equal(d[0], d[1])
    u = hash_uniform(seeds, counters, 1000, 2)
    assert 0 < float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.05


def test_fast_sampler_follows_the_distribution(adapter):
    """Inverse-CDF sampling over blocks picks ids with their softmax probabilities."""
    from diffusion_plugin.families.diffusiongemma_batched import inverse_cdf

    probs = torch.tensor([0.1, 0.0, 0.6, 0.3] + [0.0] * 1200)
    e = probs.expand(1, 20000, -1).contiguous()
    u = torch.rand(1, 20000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ids = inverse_cdf(e, u)[0]
    freq = torch.bincount(ids, minlength=4)[:4].double() / ids.numel()
    assert int(freq[1]) == 0 and torch.allclose(freq, probs[:4].double(), atol=0.02)


@pytest.mark.parametrize("scale", [2.0, 0.5], ids=["peaked", "spread"])
def test_the_blocked_pass_draws_with_the_softmax_probabilities(adapter, monkeypatch, scale):
    """The blocked pass's draw (the sub-block from the masses kept, the id inside it from its
    logits computed again) picks ids with the softmax probabilities of the processed logits,
    across blocks and the tail (the tiny vocabulary of 1,039 in blocks of 256). Peaked (top id
    ~0.8): id by id; spread (~190 ids carry it): by bins of 64 ids (an id's own frequency is
    noise there). Deterministic draws; a draw one id or one sub-block off fails by ~10x the bound."""
    from diffusion_plugin.families import diffusiongemma_blocked as blocked

    monkeypatch.setattr(blocked, "VOCAB_BLOCK", 256)
    model, H, n = adapter.model, adapter.model.lm_head.weight.shape[1], 20000
    g = torch.Generator().manual_seed(3)
    hidden = (torch.randn(1, H, generator=g) * scale).expand(n, H).contiguous()  # one position, n draws
    inv_t, uniform = torch.tensor([1 / 0.8]), torch.rand(n, generator=g, dtype=torch.float64)
    with torch.no_grad():
        sampled, argmax, _, _ = blocked.Blocked().row(model, hidden, inv_t, uniform)
        cap = model.final_logit_softcapping
        probs = torch.softmax(torch.tanh(model.lm_head(hidden[0]) / cap) * cap * inv_t, -1).double()
    freq = torch.bincount(sampled, minlength=probs.numel()).double() / n
    assert int(argmax[0]) == int(probs.argmax())
    if scale > 1:
        assert probs.max() > 0.5 and (freq - probs).abs().sum() < 0.05, (freq - probs).abs().sum()
    else:
        def bins(f):
            return torch.zeros(-(-f.numel() // 64), dtype=f.dtype).index_add_(0, torch.arange(f.numel()) // 64, f)

        assert probs.max() < 0.1 and (bins(freq) - bins(probs)).abs().sum() < 0.04


# The shape model's experts (128 x top 8 at hidden 128), then wider hiddens where the BLAS's
# blocking differs (fewer experts, to keep the weights small).
@pytest.mark.parametrize("hidden,inter,experts,top_k", [(128, 64, 128, 8), (1024, 352, 16, 4), (2816, 704, 4, 2)])
def test_grouped_experts_are_batch_invariant_and_close_to_hf(hidden, inter, experts, top_k):
    module = _experts_case(hidden, inter, experts, top_k)
    args = (module.gate_up_proj, module.down_proj, module.act_fn)
    with torch.no_grad():
        for seed in range(3):
            row = _tokens(256, hidden, experts, top_k, seed)  # one canvas
            alone = moe.grouped_experts(*args, *row)
            hf = module(*row)
            assert torch.allclose(alone, hf, rtol=1e-5, atol=1e-5 * float(hf.abs().max()))
            for mates in ([1], [100], [256, 256, 37], [5, 256, 256, 256, 256]):
                rows = [_tokens(n, hidden, experts, top_k, 100 * seed + j) for j, n in enumerate(mates)]
                at = len(rows) // 2
                rows.insert(at, row)
                out = moe.grouped_experts(*args, *(torch.cat(parts) for parts in zip(*rows, strict=True)))
                first = sum(r[0].shape[0] for r in rows[:at])
                assert torch.equal(out[first:first + 256], alone), f"seed {seed}, mates {mates}"


def test_fast_step_runs_two_grouped_gemms_per_moe_layer_whatever_the_rows(adapter):
    """The batched trunk: a denoise-only step makes two grouped expert GEMMs per layer, at 1 row
    and at 4 (HF's experts make two per expert hit)."""
    layers = len(adapter.layer_types)
    counts = {}

    def count(runner, batch, when):
        if batch.encode or not batch.denoise:
            return
        if when == "before":
            count.start = moe.GEMM_CALLS[0]
        else:
            counts.setdefault(len(batch.denoise), []).append(moe.GEMM_CALLS[0] - count.start)

    _run(adapter, {0: [0, 1, 2, 3]}, steps=4, on_step=count, rowwise=False)
    _run(adapter, {0: [0]}, steps=4, on_step=count, rowwise=False)
    assert set(counts) == {1, 4}
    assert {c for per_step in counts.values() for c in per_step} == {2 * layers}, counts


def test_grouped_experts_make_no_host_sync_and_a_fixed_op_count():
    """The grouped experts dispatch the same ops for any routing and any token count, none of
    them a host synchronisation."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    module = _experts_case(128, 64, 128, 8)
    seen = set()
    with torch.no_grad():
        for n, seed in ((1, 0), (256, 1), (1024, 2)):
            tokens, ops = _tokens(n, 128, 128, 8, seed), Ops()
            with ops:
                moe.grouped_experts(module.gate_up_proj, module.down_proj, module.act_fn, *tokens)
            seen.add(tuple(ops.names))
            assert not {"aten._local_scalar_dense", "aten.nonzero", "aten.item"} & set(ops.names), ops.names
            assert ops.names.count("tandem.grouped_mm") == 2  # (torch._grouped_mm, as one opaque op)
    assert len(seen) == 1 and len(next(iter(seen))) <= 45, seen  # 41 here (HF: ~10 per expert hit)


def test_a_joining_row_copies_no_kv(adapter):
    """Rows' K/V stay where the encoder wrote them: when a row joins, the pool is the same memory,
    the other rows keep their pages and contents, and the decoder reads the pool itself."""
    seen = {}

    def check(runner, batch, when):
        if runner.pool is None:
            return
        pool = runner.pool
        rows = {s: r for s, r in runner.rows.items() if s not in batch.admit and r.cur_len}
        if when == "before" and batch.admit and rows:
            seen["ptrs"] = [t.data_ptr() for t in (*pool.k, *pool.v)]
            seen["rows"] = {s: [(layer.first_page, layer.length, list(layer.pages), pool.k[i][layer.pages].clone(),
                                 pool.v[i][layer.pages].clone()) for i, layer in enumerate(r.cache.layers)]
                            for s, r in rows.items()}
        elif when == "after" and "rows" in seen and "checked" not in seen:
            assert [t.data_ptr() for t in (*pool.k, *pool.v)] == seen["ptrs"]
            for s, layers in seen["rows"].items():
                for i, (first, length, pages, k, v) in enumerate(layers):
                    layer = runner.rows[s].cache.layers[i]
                    for q, page in enumerate(pages):  # every page it kept: same page, same written tokens
                        logical = first + q
                        if logical < layer.first_page:
                            continue  # a sliding layer gave it back
                        assert layer.pages[logical - layer.first_page] == page
                        n = min(attention.ATTN_BLOCK, length - logical * attention.ATTN_BLOCK)
                        assert torch.equal(pool.k[i][page, :, :n], k[q, :, :n])
                        assert torch.equal(pool.v[i][page, :, :n], v[q, :, :n])
            spec = runner.passes.views._spec[1]
            assert all(spec.layers[i].k_pages is pool.k[i] and spec.layers[i].v_pages is pool.v[i]
                       for i in range(len(pool.k)))
            seen["checked"] = True

    _run(adapter, {0: [0, 1], 2: [2]}, steps=8, on_step=check, rowwise=False)
    assert seen.get("checked")


def test_retired_rows_give_their_pages_back(adapter):
    """The pool holds exactly the pages of the rows alive (a sliding layer's old pages, a retired
    row's pages go back), and is empty once the last row leaves."""
    state = {"freed": 0}

    def check(runner, batch, when):
        state["runner"] = runner
        if when == "after" and runner.pool is not None:
            state["freed"] += len(batch.free)
            for i in range(len(runner.pool.k)):
                assert runner.pool.pages_in_use(i) == sum(len(r.cache.layers[i].pages) for r in runner.rows.values())

    _run(adapter, {0: [6, 0], 3: [7], 4: [1]}, steps=3, max_tokens=40, max_batch=2, on_step=check)
    runner = state["runner"]
    assert state["freed"] >= 2
    for seq_id in list(runner.rows):
        runner.free(seq_id)
    assert all(runner.pool.pages_in_use(i) == 0 for i in range(len(runner.pool.k)))


def test_paged_layers_return_what_dynamic_layers_return(adapter):
    """The encoder's attention sees the same keys and values (and mask sizes) as with HF's cache."""
    pool = kv_view.KVPool(adapter.kv_layout(), 16, torch.float32, "cpu")
    paged, plain = adapter.new_cache(pool), adapter.new_cache()
    g = torch.Generator().manual_seed(0)
    for n in (90, 32, 250, 32):
        for i, (h, d) in enumerate(adapter.kv_layout()):
            k, v = torch.randn(1, h, n, d, generator=g), torch.randn(1, h, n, d, generator=g)
            a, b = paged.update(k, v, i), plain.update(k, v, i)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
            assert paged.get_mask_sizes(32, i) == plain.get_mask_sizes(32, i)
            assert paged.get_seq_length(i) == plain.get_seq_length(i)


def test_fast_mode_is_batch_invariant_for_prompts_of_one_length(adapter):
    """Equal-length prompts arriving together (their prefills could share one encoder pass) and
    eight rows committing together: each row as alone. Batching two short prefills once moved a
    row's K/V by ~1e-6 and flipped its samples (the CPU BLAS takes another kernel for a few rows)."""
    prompt = adapter.tokenizer("The river").input_ids  # one prompt, eight seeds (as n=8 sends it)

    def run(ids):
        sched = Scheduler(max_batch=8, canvas_length=adapter.canvas_length)
        runner, seqs = Runner(adapter, "fast", kv_budget_bytes=64 << 20), {}
        for i in ids:
            seqs[f"s{i}"] = Sequence(f"s{i}", prompt, SamplingParams(max_tokens=40, seed=i, eos_token_ids=(),
                                                                     **adapter.defaults()))
            sched.add(seqs[f"s{i}"])
        while sched.has_work():
            batch, _ = sched.schedule()
            if not batch.empty():
                sched.update(runner.execute(batch, seqs))
        return {s: q.output_ids for s, q in seqs.items()}

    together = run(range(8))
    for i in (0, 3, 7):
        assert run([i])[f"s{i}"] == together[f"s{i}"], f"row {i} depends on its batch mates"
