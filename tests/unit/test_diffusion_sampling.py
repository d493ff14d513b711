"""vLLM's sampling fields and the canvas controls on the real tiny diffusion model, both samplers.

``filters`` against straightforward references (vLLM's sort-based top-p), then their effect on
the real batcher's output: top_k=1 (and a tiny top_p, min_p=1) sample the argmax, so nothing
random is left and the seed does not matter; an allowed set is all that appears; min_tokens
delays the finish; pinned positions keep their seed tokens; exact mode with top_k or an allowed
set equals HF ``generate()`` given the same mask as a ``logits_processor``.
"""

import math
from dataclasses import replace

import pytest
import torch

from diffusion_plugin.batcher.request import SamplingParams, Sequence
from diffusion_plugin.batcher.scheduler import Scheduler
from diffusion_plugin.families.diffusiongemma import DiffusionGemmaAdapter
from diffusion_plugin.step import filters
from diffusion_plugin.step.runner import Runner
from workers import tiny_models

NEG = float("-inf")


def _params(**kw) -> SamplingParams:
    base = dict(max_tokens=8, max_denoising_steps=4, entropy_bound=1.0, t_min=0.5, t_max=1.0,
                stability_threshold=1, confidence_threshold=0.5, seed=0, eos_token_ids=(7,))
    return SamplingParams(**{**base, **kw})


def _top_p_reference(x: torch.Tensor, p: float) -> torch.Tensor:
    """vLLM's ``apply_top_k_top_p`` (ascending sort, drop while the cumulative mass <= 1 - p)."""
    s, order = torch.sort(x, dim=-1)
    drop = torch.cumsum(s.softmax(-1), -1) <= 1 - p
    drop[:, -1] = False
    return x.clone().scatter_(-1, order, s.masked_fill(drop, NEG))


@pytest.mark.parametrize("scale", [0.01, 1.0, 5.0, 30.0])
@pytest.mark.parametrize("top_p", [1e-6, 0.3, 0.9, 0.999])
def test_top_p_keeps_what_a_full_sort_keeps(scale, top_p, monkeypatch):
    monkeypatch.setattr(filters, "TOP_P_CANDIDATES", 64)  # flat rows fall back to the sort
    g = torch.Generator().manual_seed(int(scale * 100) + int(top_p * 1000))
    x = torch.randn(6, 3000, generator=g) * scale
    got = x.clone()
    filters.apply(got, _params(top_p=top_p), 0)
    kept, want = ~torch.isinf(got), ~torch.isinf(_top_p_reference(x, top_p))
    # the same set, but for the one token at the boundary, where float32 sums in another order
    # (vLLM's ascending cumsum of tiny masses vs the top candidates' descending one) may round apart
    assert ((kept ^ want).sum(-1) <= 1).all()
    assert (kept | want).sum() - (kept & want).sum() <= 3
    assert torch.equal(got[kept], x[kept])  # the kept logits unchanged


def test_top_k_min_p_allowed_and_min_tokens_masks():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 50, generator=g)
    got = x.clone()
    filters.apply(got, _params(top_k=3), 0)
    assert ((~torch.isinf(got)).sum(-1) == 3).all()
    assert torch.equal(got.argmax(-1), x.argmax(-1))
    got = x.clone()
    filters.apply(got, _params(min_p=0.5), 0)
    probs = x.softmax(-1)
    assert torch.equal(~torch.isinf(got), probs >= 0.5 * probs.max(-1, keepdim=True).values)
    got = x.clone()
    filters.apply(got, _params(allowed_token_ids=(2, 7, 40)), 0)
    assert torch.equal(torch.nonzero(~torch.isinf(got[0])).flatten(), torch.tensor([2, 7, 40]))
    # min_tokens: EOS (7) refused at the output positions below it: a block 3 tokens in, min 5
    got = x.clone()
    filters.apply(got, _params(min_tokens=5), 3)
    assert torch.isinf(got[:2, 7]).all() and not torch.isinf(got[2:, 7]).any()
    assert torch.isinf(got).sum() == 2
    got = x.clone()
    filters.apply(got, _params(logit_bias=((4, 2.0), (9, -100.0))), 0, temperature=0.5)
    assert torch.allclose(got[:, 4], x[:, 4] + 4.0) and torch.allclose(got[:, 9], x[:, 9] - 200.0)
    assert torch.equal(got[:, 5], x[:, 5])
    assert not _params(min_tokens=5).filtered(5)  # past it: nothing to do
    assert not _params(min_tokens=5, eos_token_ids=()).filtered(0)  # ignore_eos: no EOS to refuse


# -- on the real tiny model ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def adapter():
    torch.set_num_threads(1)
    return DiffusionGemmaAdapter(str(tiny_models.build(tiny_models.TINY_DIFFUSIONGEMMA)))


PROMPTS = [[(5 * i + j) % 900 + 3 for j in range(9 + 7 * i)] for i in range(3)]


def _run(adapter, sampler, prompts_params: list[tuple[list[int], SamplingParams]]) -> list[Sequence]:
    sched = Scheduler(max_batch=4, canvas_length=adapter.canvas_length)
    runner = Runner(adapter, sampler)
    seqs = {}
    for i, (prompt, p) in enumerate(prompts_params):
        seqs[f"s{i}"] = Sequence(seq_id=f"s{i}", prompt_ids=prompt, params=p)
        sched.add(seqs[f"s{i}"])
    while sched.has_work():
        batch, _ = sched.schedule()
        if not batch.empty():
            sched.update(runner.execute(batch, seqs))
    return list(seqs.values())


def _p(adapter, **kw) -> SamplingParams:
    base = {**adapter.defaults(), "max_denoising_steps": 5, "t_min": 0.8, "t_max": 1.5, "max_tokens": 40, "seed": 1,
            "eos_token_ids": adapter.eos_token_ids}
    return SamplingParams(**{**base, **kw})


@pytest.mark.parametrize("sampler", ["exact", "fast"])
@pytest.mark.parametrize("field", [{"top_k": 1}, {"top_p": 1e-9}, {"min_p": 1.0}])
def test_a_one_token_distribution_samples_the_argmax(adapter, sampler, field):
    """Only the argmax survives: at every step the sampled canvas is the argmax canvas (and, each
    position's entropy 0, all of it is accepted: the next step's canvas is that argmax). Its batch
    mate, unfiltered at a high temperature, samples off the argmax at some step."""
    sched = Scheduler(max_batch=4, canvas_length=adapter.canvas_length)
    runner = Runner(adapter, sampler)
    seqs = {"f": Sequence("f", PROMPTS[1], _p(adapter, **field)), "u": Sequence("u", PROMPTS[2], _p(adapter))}
    for seq in seqs.values():
        sched.add(seq)
    steps, unfiltered_off = 0, False
    while sched.has_work():
        batch, _ = sched.schedule()
        if batch.empty():
            continue
        sched.update(runner.execute(batch, seqs))
        for seq_id in batch.denoise:
            row = runner.rows.get(seq_id)
            if row is None or row.argmax is None:
                continue
            same = torch.equal(row.canvas, row.argmax)
            if seq_id == "f":
                assert same
                steps += 1
            else:
                unfiltered_off |= not same
    assert steps >= 2 and unfiltered_off


@pytest.mark.parametrize("sampler", ["exact", "fast"])
def test_only_allowed_ids_appear(adapter, sampler):
    allowed = (11, 200, 513, 900)
    seqs = _run(adapter, sampler, [(PROMPTS[i], _p(adapter, seed=i, allowed_token_ids=allowed)) for i in range(3)])
    for s in seqs:
        assert len(s.output_ids) == 40 and set(s.output_ids) <= set(allowed)  # no EOS allowed: to max_tokens


@pytest.mark.parametrize("sampler", ["exact", "fast"])
def test_min_tokens_delays_the_finish(adapter, sampler):
    """Only EOS and one token allowed, at a high temperature: EOS comes early. A seed whose answer
    ends before 40 tokens is taken (fails loudly if none of 20 does); with min_tokens=40 the
    same request goes on to at least 40 tokens with no EOS before."""
    eos = adapter.eos_token_ids[0]
    allowed = (eos, 300)
    for seed in range(20):
        early = _run(adapter, sampler, [(PROMPTS[0], _p(adapter, seed=seed, max_tokens=64,
                                                        allowed_token_ids=allowed))])[0]
        if len(early.output_ids) < 40:
            break
    else:
        raise AssertionError("no seed of 20 ended before 40 tokens")
    held = _run(adapter, sampler, [(PROMPTS[0], _p(adapter, seed=seed, max_tokens=64, allowed_token_ids=allowed,
                                                   min_tokens=40))])[0]
    assert len(held.output_ids) >= 40 and set(held.output_ids) == {300}


@pytest.mark.parametrize("sampler", ["exact", "fast"])
def test_pinned_positions_keep_their_seed_tokens(adapter, sampler):
    seed_canvas = tuple(range(100, 120))
    pinned = (0, 3, 7, 19)
    seqs = _run(adapter, sampler, [(PROMPTS[i], _p(adapter, seed=i, seed_canvas=seed_canvas, pinned=pinned,
                                                   eos_token_ids=())) for i in range(3)])
    for s in seqs:
        assert [s.output_ids[j] for j in pinned] == [seed_canvas[j] for j in pinned]
    # and the rows stay batch-invariant in fast mode / HF-shaped per row in exact mode: alone == batched
    alone = _run(adapter, sampler, [(PROMPTS[2], _p(adapter, seed=2, seed_canvas=seed_canvas, pinned=pinned,
                                                    eos_token_ids=()))])[0]
    assert alone.output_ids == seqs[2].output_ids


@pytest.mark.parametrize("sampler", ["exact", "fast"])
def test_a_large_logit_bias_makes_its_token_the_output(adapter, sampler):
    seqs = _run(adapter, sampler, [(PROMPTS[0], _p(adapter, logit_bias=((321, 100.0),), eos_token_ids=()))])
    assert seqs[0].output_ids == [321] * 40


@pytest.mark.parametrize("sampler", ["exact", "fast"])
def test_filtered_rows_leave_their_batch_mates_alone(adapter, sampler):
    plain = _run(adapter, sampler, [(PROMPTS[0], _p(adapter, seed=5))])[0].output_ids
    mixed = _run(adapter, sampler, [(PROMPTS[0], _p(adapter, seed=5)),
                                    (PROMPTS[1], _p(adapter, seed=6, top_k=3, top_p=0.8, min_tokens=10, logit_bias=((5, 3.0),))),
                                    (PROMPTS[2], _p(adapter, seed=7, seed_canvas=(5, 6), pinned=(1,)))])
    assert mixed[0].output_ids == plain


class _Mask:
    """An HF logits processor: -inf outside ``allowed`` (or outside the top k)."""

    def __init__(self, allowed=None, top_k=None):
        self.allowed, self.top_k = allowed, top_k

    def __call__(self, input_ids, scores):
        if self.top_k is not None:
            kth = torch.topk(scores, self.top_k, dim=-1).values[..., -1:]
            return scores.masked_fill(scores < kth, NEG)
        keep = torch.zeros(scores.shape[-1], dtype=torch.bool)
        keep[list(self.allowed)] = True
        return scores.masked_fill(~keep, NEG)


@pytest.mark.parametrize("field", [{"top_k": 4}, {"allowed_token_ids": (11, 200, 513, 900, 1028)}])
def test_exact_mode_with_a_mask_equals_hf_generate_given_that_mask(adapter, field):
    """HF's generate() has no top_k or allowed set; given the same mask as a logits_processor (it
    runs before the temperature, with which a mask commutes) it must give exactly exact mode's tokens."""
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.generation.logits_process import LogitsProcessorList

    knobs = {"t_min": 0.8, "t_max": 1.5, "max_denoising_steps": 5}
    p = _p(adapter, seed=9, max_tokens=64, **field)
    ours = _run(adapter, "exact", [(PROMPTS[2], p)])[0].output_ids
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(adapter.tokenizer.name_or_path, dtype=torch.float32)
    torch.manual_seed(9)
    mask = _Mask(top_k=field.get("top_k"), allowed=field.get("allowed_token_ids"))
    out = model.eval().generate(torch.tensor([PROMPTS[2]]), max_new_tokens=64, logits_processor=LogitsProcessorList(
        [mask]), **knobs).sequences[0, len(PROMPTS[2]):].tolist()
    cut = next((i for i, t in enumerate(out) if t in adapter.eos_token_ids), None)
    assert ours == (out[:cut] if cut is not None else out)[:64]


def test_the_filter_leaves_a_position_with_mass():
    """Every position keeps at least one token whatever the fields (no NaN downstream)."""
    x = torch.randn(4, 30)
    for p in (_params(top_k=1, top_p=1e-9, min_p=1.0), _params(allowed_token_ids=(3,), top_p=0.5)):
        got = x.clone()
        filters.apply(got, p, 0)
        assert ((~torch.isinf(got)).sum(-1) >= 1).all()
        assert not math.isnan(torch.logsumexp(got, -1).sum().item())


def test_score_blocks_plan_the_prompt_in_canvas_sized_reads():
    seq = Sequence("s", [1], _params(), score_ids=list(range(2, 72)), score_k=2)
    C = 32
    assert seq.score_blocks(C) == 3
    plans = []
    for b in range(4):
        seq.block = b
        plans.append(seq.plan(C))
    assert [p.scoring for p in plans] == [True, True, True, False]
    assert [p.width for p in plans[:3]] == [32, 32, 6] and plans[2].seed == tuple(range(66, 72))
    assert plans[0].pinned == tuple(range(32)) and plans[3].steps == 4
    seeded = replace(seq, params=_params(seed_canvas=(5, 6, 7), pinned=(1,)))
    seeded.block = 3
    assert seeded.plan(C).seed == (5, 6, 7) and seeded.plan(C).pinned == (1,)


# -- scoring, echo, read_only through the engine ----------------------------------------------------


def _engine_run(sampler, bodies: list[tuple[str, dict]]):
    """Runs the bodies through a real engine on the tiny model, concurrently; their answers."""
    import asyncio

    from diffusion_plugin.engine import DiffusionEngine

    path = str(tiny_models.build(tiny_models.TINY_DIFFUSIONGEMMA))

    async def main():
        engine = DiffusionEngine("m", path, {"sampler": sampler, "num_threads": 1})
        await engine.start()
        try:
            async def one(i, route, body):
                return [x async for x in getattr(engine, route)({"model": "m", **body}, f"r{i}")]
            return await asyncio.gather(*(one(i, r, b) for i, (r, b) in enumerate(bodies)))
        finally:
            await engine.shutdown()

    return asyncio.run(main())


TEXT = "The river runs past the mill and the old bridge, then on to the sea where the boats wait. " * 3


@pytest.mark.parametrize("sampler", ["exact", "fast"])
def test_echo_scores_the_prompt_the_same_alone_or_batched(adapter, sampler):
    """lm-eval's loglikelihood request (echo, logprobs 1, max_tokens 0 or 1, temperature 0): the
    prompt's tokens with a logprob each (the first None), the same alone, in a list of prompts,
    next to another request and whatever the seed; with max_tokens 1 one more token follows."""
    ids = adapter.tokenizer(TEXT).input_ids
    assert len(ids) > adapter.canvas_length + 2  # more than one score block
    score = {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0}
    alone, batched, next_one, other = _engine_run(sampler, [
        ("completions", score),
        ("completions", {**score, "prompt": [ids[:20], ids], "seed": 77}),
        ("completions", {**score, "max_tokens": 1}),
        ("completions", {"prompt": "Hello", "max_tokens": 40, "ignore_eos": True}),
    ])
    a = alone[0]["choices"][0]
    assert a["text"] == adapter.tokenizer.decode(ids, skip_special_tokens=True)
    assert a["finish_reason"] == "length" and alone[0]["usage"]["completion_tokens"] == 0
    lp = a["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(x <= 0 for x in lp["token_logprobs"][1:])
    for tok, x, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
        assert tok in top and top[tok] == x and max(top.values()) <= max(x, max(top.values()))
    assert lp["text_offset"] == sorted(lp["text_offset"])
    b = batched[0]["choices"]
    assert [c["index"] for c in b] == [0, 1]
    assert b[1]["logprobs"] == lp  # the same numbers batched, another seed
    assert len(b[0]["logprobs"]["token_logprobs"]) == 20  # (its reads differ: a block is read as a whole)
    n = next_one[0]["choices"][0]
    assert n["text"].startswith(a["text"]) and next_one[0]["usage"]["completion_tokens"] == 1
    assert n["logprobs"]["token_logprobs"][:len(ids)] == lp["token_logprobs"]
    assert len(n["logprobs"]["tokens"]) == len(ids) + 1
    assert other[0]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("sampler", ["exact", "fast"])
def test_prompt_logprobs_as_vllm_returns_them(adapter, sampler):
    (comp,), (chat,) = _engine_run(sampler, [
        ("completions", {"prompt": TEXT, "prompt_logprobs": 2, "max_tokens": 3}),
        ("chat", {"messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": 0, "max_tokens": 3})])
    ids = adapter.tokenizer(TEXT).input_ids
    plp = comp["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for t, entry in zip(ids[1:], plp[1:], strict=True):
        mine = entry[str(t)]
        assert mine["logprob"] <= 0 and mine["rank"] >= 1
        assert 2 <= len(entry) <= 3  # the prompt token and the top 2
        ranked = sorted(entry.values(), key=lambda e: e["rank"])
        if mine["rank"] == 1:
            assert ranked[0] is mine or ranked[0]["logprob"] == mine["logprob"]
    assert "prompt_logprobs" in chat and chat["prompt_logprobs"][0] is None
    assert "prompt_logprobs" not in chat["choices"][0]


@pytest.mark.parametrize("sampler", ["exact", "fast"])
def test_read_only_returns_one_pass_argmax_with_logprobs_and_pins(adapter, sampler):
    seed = [300, 301, 302, 303, 304, 305]
    (out,) = _engine_run(sampler, [("completions", {"prompt": TEXT, "logprobs": 0, "diffusion": {
        "read_only": True, "seed_canvas": seed, "pinned": [1, 4]}})])
    out = out[0]
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length" and out["usage"]["completion_tokens"] == adapter.canvas_length
    assert len(choice["logprobs"]["tokens"]) == adapter.canvas_length
    from diffusion_plugin.api.token_text import token_string
    tokens = choice["logprobs"]["tokens"]
    assert tokens[1] == token_string(adapter.tokenizer, 301) and tokens[4] == token_string(adapter.tokenizer, 304)


@pytest.mark.parametrize("body, param", [
    ({"diffusion": {"canvas_length": 8}}, "diffusion.canvas_length"),
    ({"diffusion": {"seed_canvas": [1] * 33}}, "diffusion.seed_canvas"),
    ({"diffusion": {"seed_canvas": [1, 2], "pinned": [2]}}, "diffusion.pinned"),
    ({"diffusion": {"pinned": [0]}}, "diffusion.pinned"),
    ({"allowed_token_ids": [5, 10**6]}, "allowed_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"seed": 2**63}, "seed"),
    ({"logit_bias": {"5": 1, "99999": 2}}, "logit_bias"),
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    ({"min_tokens": 2, "response_format": {"type": "json_object"}}, "min_tokens"),
])
def test_bad_sampling_and_canvas_fields_are_400s_naming_them(adapter, body, param):
    from tandem_core.errors import TandemError

    (out,) = _engine_run("fast", [("completions", {"prompt": "Hi", "max_tokens": 4, **body})])
    assert len(out) == 1 and isinstance(out[0], TandemError), out
    assert out[0].status == 400 and out[0].param == param, out[0].message
    if param == "seed":
        assert "less_than_equal" in out[0].message


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(adapter):
    import json

    from tandem_core.errors import TandemError

    body = {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 40, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    out, bad = _engine_run("fast", [("chat", body), ("chat", {**body, "stream_options": {"made_up": 1}})])
    chunks = [json.loads(c[len("data: "):]) for c in out if c.startswith("data: {")]
    assert all("usage" in c for c in chunks)
    used = [c["usage"]["completion_tokens"] for c in chunks]
    assert used == sorted(used) and used[-1] == 40 == chunks[-1]["usage"]["completion_tokens"]
    assert len({c["usage"]["prompt_tokens"] for c in chunks}) == 1
    assert isinstance(bad[0], TandemError) and bad[0].param == "stream_options.made_up"


@pytest.mark.parametrize("fields", [
    {"top_k": 5}, {"top_p": 0.7}, {"min_p": 0.2}, {"allowed_token_ids": (1, 7, 30, 44)}, {"min_tokens": 4},
    {"logit_bias": ((3, 5.0), (8, -3.0))}, {"top_k": 20, "top_p": 0.5, "min_p": 0.05},
    {"allowed_token_ids": tuple(range(0, 60, 3)), "top_p": 0.6, "min_tokens": 2},
])
@pytest.mark.parametrize("scale", [0.3, 4.0])
def test_the_fast_form_keeps_what_apply_keeps(fields, scale, monkeypatch):
    """``prepare`` + ``cut`` (fast mode: exponents zeroed, thresholds per position) keep the tokens
    ``apply`` (exact mode: -inf) keeps, and the same argmax."""
    from diffusion_plugin.step.attention import MIN_EXPONENT

    monkeypatch.setattr(filters, "TOP_P_CANDIDATES", 8)  # some positions take the sort
    g = torch.Generator().manual_seed(len(str(fields)))
    x = torch.randn(6, 64, generator=g) * scale
    p = _params(**fields)
    want = x.clone()
    filters.apply(want, p, 1, temperature=0.5)
    y = x.clone()
    filters.prepare(y, p, 1, temperature=0.5)
    top, argmax = y.max(-1)
    y.sub_(top[:, None]).clamp_(min=MIN_EXPONENT)
    e = torch.exp(y)
    filters.cut(y, e, p, 1)
    assert torch.equal(argmax, want.argmax(-1))
    kept, expected = e > 0, ~torch.isinf(want)
    assert ((kept ^ expected).sum(-1) <= 1).all() and (kept ^ expected).sum() <= 2, (kept ^ expected).sum()


def test_stop_token_ids_include_stop_str_and_skip_special_tokens(adapter):
    """vLLM's three output fields: a stop token id ends a choice (ignore_eos or not), a stop string
    stays in the text when asked, special tokens stay in the text with skip_special_tokens false."""
    from tests.texts import stop_string_in

    tool = adapter.tokenizer.convert_tokens_to_ids("<|tool>")
    base = {"prompt": "The river", "max_tokens": 40, "ignore_eos": True, "temperature": 0}
    stopped, special, plain, *wholes = _engine_run("fast", [
        ("completions", {**base, "stop_token_ids": [321], "logit_bias": {"321": 100}}),
        ("completions", {**base, "logit_bias": {str(tool): 100}, "skip_special_tokens": False}),
        ("completions", {**base, "logit_bias": {str(tool): 100}}),
        *[("completions", {**base, "seed": seed, "temperature": 1}) for seed in range(8)]])
    s = stopped[0]["choices"][0]
    assert s["finish_reason"] == "stop" and s["text"] == "" and stopped[0]["usage"]["completion_tokens"] == 0
    assert special[0]["choices"][0]["text"] == "<|tool>" * 40 and plain[0]["choices"][0]["text"] == ""
    texts = [w[0]["choices"][0]["text"] for w in wholes]
    seed, text, stop = next(((i, t, stop_string_in(t)) for i, t in enumerate(texts) if stop_string_in(t)),
                            (None, None, None))
    assert stop is not None, f"none of {len(texts)} answers had a stop string to take: {texts!r}"
    again = {**base, "seed": seed, "temperature": 1, "stop": stop}
    kept, cut = _engine_run("fast", [("completions", {**again, "include_stop_str_in_output": True}),
                                     ("completions", again)])
    assert kept[0]["choices"][0]["text"] == text[:text.index(stop) + len(stop)]
    assert cut[0]["choices"][0]["text"] == text[:text.index(stop)]


@pytest.mark.parametrize("logprobs", [None, 2])
def test_echo_streams_the_prompt_first_and_equals_the_whole_answer(adapter, logprobs):
    import json

    body = {"prompt": TEXT, "echo": True, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "logprobs": logprobs}
    whole, chunks = _engine_run("fast", [("completions", body), ("completions", {**body, "stream": True})])
    choice = whole[0]["choices"][0]
    payloads = [json.loads(c[len("data: "):]) for c in chunks if c.startswith("data: {")]
    texts = [p["choices"][0]["text"] for p in payloads]
    assert texts[0] == adapter.tokenizer.decode(adapter.tokenizer(TEXT).input_ids, skip_special_tokens=True)
    assert "".join(texts) == choice["text"] and choice["text"].startswith(texts[0])
    if logprobs is not None:
        joined = {k: [v for p in payloads if p["choices"][0]["logprobs"] for v in p["choices"][0]["logprobs"][k]]
                  for k in choice["logprobs"]}
        assert joined == choice["logprobs"]
        assert choice["logprobs"]["text_offset"] == sorted(choice["logprobs"]["text_offset"])
