"""Grammar-constrained canvases in the runner (``diffusion_plugin.step.grammar``), both samplers, on the
tiny random DiffusionGemma: a constrained row's output parses and validates whatever the model
prefers (it spans several blocks, so the grammar state crosses block commits), and a constrained
row never changes an unconstrained batch mate's tokens."""

import json
import re

import jsonschema
import pytest
import torch

from diffusion_plugin.batcher.request import SamplingParams, SeqStatus, Sequence
from diffusion_plugin.batcher.scheduler import Scheduler
from diffusion_plugin.families.diffusiongemma import DiffusionGemmaAdapter
from diffusion_plugin.step.grammar import GrammarCompiler
from diffusion_plugin.step.runner import Runner
from workers import tiny_models

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                      "ok": {"type": "boolean"}},
     "required": ["name", "age", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -5, "maximum": 5}, "y": {"type": "integer", "minimum": -5, "maximum": 5}},
        "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
     "required": ["color", "code"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def adapter():
    torch.set_num_threads(1)
    return DiffusionGemmaAdapter(str(tiny_models.build(tiny_models.TINY_DIFFUSIONGEMMA)))


@pytest.fixture(scope="module")
def compiler(adapter):
    return GrammarCompiler(adapter.tokenizer, adapter.vocab_size, adapter.eos_token_ids)


def run(adapter, sampler, grammars, max_tokens=160):
    """One batch: sequence i with ``grammars[i]`` (None: unconstrained) and seed 3 + i; its output ids."""
    sched = Scheduler(max_batch=len(grammars), canvas_length=adapter.canvas_length, row_boundaries=False)
    runner, seqs = Runner(adapter, sampler), {}
    for i, grammar in enumerate(grammars):
        params = SamplingParams(max_tokens=max_tokens, seed=3 + i, eos_token_ids=adapter.eos_token_ids,
                                **{**adapter.defaults(), "max_denoising_steps": 8})
        seq = Sequence(seq_id=f"s{i}", prompt_ids=[5, 6, 7, 8 + i], params=params, grammar=grammar)
        seqs[seq.seq_id] = seq
        sched.add(seq)
    while sched.has_work():
        batch, _ = sched.schedule()
        if not batch.empty():
            sched.update(runner.execute(batch, seqs))
    return [seqs[f"s{i}"] for i in range(len(grammars))]


@pytest.mark.parametrize("sampler", ["exact", "fast"])
def test_constrained_rows_give_strict_schema_valid_json(adapter, compiler, sampler):
    grammars = [compiler.compile("json", json.dumps(s)) for s in SCHEMAS]
    for schema, seq in zip(SCHEMAS, run(adapter, sampler, grammars), strict=True):
        text = adapter.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        assert seq.status is SeqStatus.FINISHED_STOPPED, (seq.status, text)  # the grammar ended: EOS
        jsonschema.validate(json.loads(text), schema)  # strict: no raw control character in a string


@pytest.mark.parametrize("sampler", ["exact", "fast"])
def test_regex_and_json_object(adapter, compiler, sampler):
    regex = compiler.compile("regex", r"(yes|no|maybe)-[0-9]{2,4}")
    obj = compiler.compile("json_object", "")
    out = run(adapter, sampler, [regex, obj])
    text = [adapter.tokenizer.decode(s.output_ids, skip_special_tokens=True) for s in out]
    assert re.fullmatch(r"(yes|no|maybe)-[0-9]{2,4}", text[0]), text[0]
    assert isinstance(json.loads(text[1]), dict) and out[1].status is SeqStatus.FINISHED_STOPPED


@pytest.mark.parametrize("sampler", ["exact", "fast"])
def test_a_constrained_row_never_changes_an_unconstrained_batch_mates_tokens(adapter, compiler, sampler):
    """Fast: batch invariance; exact: each unconstrained row as HF ``generate()`` alone (its own
    row's calls; the parity tests hold exact mode to HF)."""
    grammar = compiler.compile("json", json.dumps(SCHEMAS[0]))
    alone = run(adapter, sampler, [None, None, None], max_tokens=70)
    mixed = run(adapter, sampler, [None, grammar, None], max_tokens=70)
    assert [s.output_ids for s in alone][0::2] == [s.output_ids for s in mixed][0::2]
    assert alone[1].output_ids != mixed[1].output_ids  # (the grammar did change its own row)


def test_structural_tags_with_token_elements_keep_their_own_tokens(adapter, compiler):
    """xgrammar 0.2.8's compile cache gives a structural tag compiled after another the other's
    later ``token`` elements (seen: a Gemma 4 call's ``<tool_call|>`` became ``<channel|>``, which
    its own matcher then refused). Each tag, compiled after another, allows its own tokens."""
    import numpy as np
    import xgrammar as xgr

    from diffusion_plugin.step.grammar import allowed_ids

    tok = adapter.tokenizer
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>")}

    def tag(start: str, middle: str, end: str) -> str:
        return json.dumps({"type": "structural_tag", "format": {"type": "sequence", "elements": [
            {"type": "token", "token": ids[start]}, {"type": "const_string", "value": middle},
            {"type": "token", "token": ids[end]}]}})

    for start, middle, end in [("<|channel>", "a", "<channel|>"), ("<|tool_call>", "b", "<tool_call|>"),
                               ("<|channel>", "b", "<channel|>")]:
        matcher = xgr.GrammarMatcher(compiler.compile("structural_tag", tag(start, middle, end)))
        mask = xgr.allocate_token_bitmask(1, adapter.vocab_size)
        for token in (ids[start], tok(middle, add_special_tokens=False).input_ids[0], ids[end]):
            matcher.fill_next_token_bitmask(mask, 0)
            assert list(allowed_ids(mask.numpy().view(np.uint32)[0], adapter.vocab_size)) == [token]
            assert matcher.accept_token(token)


def test_a_grammar_its_tokenizer_cannot_spell_ends_the_output_instead_of_failing_the_batch():
    """A vocabulary with no token for what the grammar needs next (here: no "b"): the mask allows
    nothing, the row's canvases end there (EOS), and nothing raises (a raise fails every row of
    the batch). Seen with bench_grammar's synthetic vocabulary at the tiny model's size."""
    import xgrammar as xgr

    from diffusion_plugin.step.grammar import RowGrammar, masked_argmax

    vocab = ["<eos>", "a", "c", "{"]
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=[0])
    compiled = GrammarCompiler(None, len(vocab), (0,), info=info).compile("regex", "ab+")
    row = RowGrammar(compiled, len(vocab), (0,), 4)
    logits = torch.zeros(4, len(vocab))
    argmax, sampled = row.draft([2, 2, 2, 2], [3, 3, 3, 3], lambda j, ids: masked_argmax(logits[j], ids),
                                lambda j, ids: masked_argmax(logits[j], ids))
    assert argmax == [1, 0, 0, 0] and sampled == [1, 0, 0, 0]  # "a", then nothing can follow: the end
    row.settle(committed=True)


@pytest.mark.parametrize("schema", [{"type": "string", "maxLength": 3}, {"type": "string"}, {"type": "object"}])
def test_json_strings_refuse_the_bytes_of_a_surrogate(schema):
    """xgrammar counts ``ED A0 80`` (the UTF-8 form of U+D800, which is no character) as one
    character; it decodes to three U+FFFD. A random byte-level model wrote a 12-character name
    under ``maxLength: 10`` that way (CI). Every JSON string refuses it; real characters of 1 to 4
    bytes still count as one."""
    import xgrammar as xgr

    vocab = [bytes([i]) for i in range(256)] + [b"<eos>"]
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=[256])
    compiled = GrammarCompiler(None, len(vocab), (256,), info=info).compile("json", json.dumps(schema))
    prefix = b'{"k": "' if schema["type"] == "object" else b'"'

    def takes(text: bytes) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        return all(matcher.accept_token(b) for b in text)

    assert not takes(prefix + b"\xed\xa0\x80")
    assert takes(prefix + b"\xed\x9f\xbf\xe4\xb8\xad\xf0\x9f\x98\x80\"")  # U+D7FF, U+4E2D, U+1F600: 3 characters
