"""The Decisions API's shared part (``tandem_core.decisions``, ``tandem_core.label_reads``) with a
fake reader: validation that names the field, the questions as the model reads them, labels read
as token sequences over a trie of prefixes, chunking, refusals, and answers in the SDK's types."""

from __future__ import annotations

import asyncio
import math

import pytest
from openai.types.decision import Decision

from tandem_core import decisions as D
from tandem_core.errors import TandemError
from tandem_core.label_reads import Ask, ProbeResult, label_ids, read_labels

QUESTIONS = [
    {"type": "predicate", "name": "p", "instructions": "It rains."},
    {"type": "choice", "instructions": "Which?", "choices": [{"value": "a"}, {"value": "true"}, {"value": True}]},
    {"type": "score", "instructions": "How much?", "levels": [{"label": "low"}, {"label": "mid"}, {"label": "high"}]},
]


class CharTokenizer:
    """One token per character; ``yes`` and ``no`` are sequences of several."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(map(chr, ids))


class FakeReader:
    """A model whose next-token log-probability depends on the context's length and the token."""

    def __init__(self, chunk=64, max_len=10_000, sees=False):
        self.tokenizer, self.chunk, self.max_len, self.sees = CharTokenizer(), chunk, max_len, sees
        self.calls: list[int] = []

    @staticmethod
    def logprob(context, token) -> float:
        return -1.0 - ((len(context) * 7 + token) % 13) / 3

    async def render(self, messages, salt):
        return [ord(c) for c in repr(messages)]

    async def probe(self, probes, salt):
        self.calls.append(len(probes))
        return [ProbeResult([self.logprob(p.prompt_ids, c) for c in p.candidates], None) for p in probes]


def _decide(body, reader=None):
    req = D.parse(body)
    reads = asyncio.run(read_labels(reader or FakeReader(), [Ask(q.messages, q.labels, q.images)
                                                             for q in req.questions], None))
    return D.decision("m", req.questions, [D.Read(r.probs, r.label_mass, r.refusal) for r in reads],
                      sum(r.input_tokens for r in reads), 0), reads


def test_answers_parse_as_the_sdks_decision_in_order_with_probabilities_summing_to_1():
    body, _ = _decide({"model": "m", "input": "x", "questions": QUESTIONS})
    d = Decision.model_validate(body)
    assert [a.type for a in d.answers] == ["predicate", "choice", "score"] and d.answers[0].name == "p"
    choice, score = d.answers[1], d.answers[2]
    assert [p.value for p in choice.probabilities] == ["a", "true", True]  # a string and a boolean stay apart
    assert abs(sum(p.probability for p in choice.probabilities) - 1) < 1e-9
    assert [(p.label, p.value) for p in score.probabilities] == [("low", 0), ("mid", 1), ("high", 2)]
    assert score.score == pytest.approx(sum(p.value * p.probability for p in score.probabilities))


def test_a_label_of_several_tokens_is_scored_as_a_sequence_over_a_trie_of_prefixes():
    reader = FakeReader()
    req = D.parse({"model": "m", "input": "x", "questions": QUESTIONS[:1]})
    (read,) = asyncio.run(read_labels(reader, [Ask(q.messages, q.labels) for q in req.questions], None))
    prompt = asyncio.run(reader.render(req.questions[0].messages, None))
    seq = {label: [ord(c) for c in label] for label in ("yes", "no")}
    lp = {label: sum(reader.logprob(prompt + ids[:j], ids[j]) for j in range(len(ids))) for label, ids in seq.items()}
    p_yes = 1 / (1 + math.exp(lp["no"] - lp["yes"]))
    assert read.probs[0] == pytest.approx(p_yes) and read.label_mass == pytest.approx(sum(map(math.exp, lp.values())))
    assert reader.calls == [1, 2, 1]  # one probe per inner prefix, level by level: the root; "y", "n"; "ye"


def test_the_first_question_goes_alone_then_chunks_level_by_level():
    reader = FakeReader(chunk=4)
    _decide({"model": "m", "input": "x", "questions": [
        {"type": "choice", "instructions": str(i), "choices": [{"value": "a"}, {"value": "b"}]} for i in range(10)]},
        reader)
    assert reader.calls == [1, 4, 4, 1]  # one probe a question (single-token labels A, B)
    reader = FakeReader(chunk=4)
    _decide({"model": "m", "input": "x", "questions": [QUESTIONS[0]] * 3}, reader)
    assert reader.calls == [1, 2, 4, 2, 3]  # roots (the first alone); "y", "n" of each (4 + 2); "ye" of each


def test_labels_have_one_length_so_none_starts_another():
    body = {"model": "m", "input": "x", "questions": [
        {"type": "choice", "instructions": "?", "choices": [{"value": f"v{i}"} for i in range(30)]},
        {"type": "score", "instructions": "?", "levels": [{"label": str(i)} for i in range(12)]}]}
    req = D.parse(body)
    assert req.questions[0].labels[:2] == ("AA", "AB") and len(set(map(len, req.questions[0].labels))) == 1
    assert req.questions[1].labels[:2] == ("00", "01")
    out, _ = _decide(body)
    assert abs(sum(p["probability"] for p in out["answers"][0]["probabilities"]) - 1) < 1e-9


def test_a_question_that_cannot_be_read_is_refused_and_the_others_answered():
    image_q = {"type": "predicate", "instructions": [{"type": "input_text", "text": "Is this a cat?"},
                                                     {"type": "input_image", "image_url": "data:image/png;base64,AA"}]}
    out, reads = _decide({"model": "m", "input": "x", "questions": [image_q, QUESTIONS[0]]})
    assert out["answers"][0] == {"type": "refusal", "name": None} and "image" in reads[0].refusal
    assert out["answers"][1]["type"] == "predicate"
    out, reads = _decide({"model": "m", "input": "x", "questions": QUESTIONS}, FakeReader(max_len=50))
    assert [a["type"] for a in out["answers"]] == ["refusal"] * 3 and "context" in reads[0].refusal


def test_input_items_become_one_conversation_with_alternating_roles():
    req = D.parse({"model": "m", "questions": QUESTIONS[:1], "input": [
        {"role": "system", "content": "sys"}, {"role": "developer", "content": "dev"},
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}, {"type": "input_json", "data": {"a": 1}}]},
        {"type": "custom_tool_call", "call_id": "k", "name": "grep", "input": "cat"},
        {"type": "custom_tool_call_output", "call_id": "k", "output": "meow"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "done"}]}]})
    roles = [m["role"] for m in req.questions[0].messages]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]  # the question last
    msgs = req.questions[0].messages
    assert msgs[0]["content"] == "sys\n\ndev" and msgs[1]["content"] == 'hi\n{"a": 1}'  # system + developer
    assert msgs[2]["content"] == "[tool call k] grep: cat" and msgs[3]["content"] == "[output of tool call k] meow"
    assert msgs[5]["content"].startswith("Statement: It rains.")


@pytest.mark.parametrize("body, where", [
    ({"questions": [QUESTIONS[0]] * 401}, "questions"),
    ({"questions": []}, "questions"),
    ({"questions": [{"type": "choice", "instructions": "?", "choices": []}]}, "questions.0.choices"),
    ({"questions": [{"type": "choice", "instructions": "?", "choices": [{"value": "a"}, {"value": "a"}]}]},
     "questions.0.choices"),
    ({"questions": [{"type": "score", "instructions": "?", "levels": [{"label": "a"}, {"value": 2}]}]},
     "questions.0.levels.1"),
    ({"questions": [{"type": "rank", "instructions": "?"}]}, "questions.0.type"),
    ({"questions": QUESTIONS, "temperature": 0}, "temperature"),
    ({"questions": QUESTIONS, "input": [{"type": "function_call_output", "call_id": "z", "output": "o"}]},
     "input.0.call_id"),
    ({"questions": QUESTIONS, "input": [{"role": "system", "content": [
        {"type": "input_image", "image_url": "x"}]}]}, "input.0.content"),
])
def test_bad_requests_are_a_400_naming_the_field(body, where):
    with pytest.raises(TandemError) as e:
        D.parse({"model": "m", "input": "x", **body})
    assert e.value.status == 400 and e.value.message.startswith(where) and e.value.param == where.split(".")[0]


def test_a_label_is_tokenized_with_the_prompts_end():
    class Spaced(CharTokenizer):  # marks a word's start, as SentencePiece does: a label alone would differ
        def encode(self, text, add_special_tokens=False):
            return [ord(c) + (500 if c != " " and (i == 0 or text[i - 1] == " ") else 0) for i, c in enumerate(text)]

        def decode(self, ids):
            return "".join(chr(t - 500 if t >= 500 else t) for t in ids)

    tok = Spaced()
    prompt = tok.encode("Answer: ")
    assert label_ids(tok, prompt, "no") == (ord("n") + 500, ord("o"))
    assert label_ids(tok, tok.encode("Answer:"), "no") == (ord("n"), ord("o"))  # glued to the word before


def test_the_openapi_body_is_generated_from_the_models_that_parse_it():
    """``gateway.http.openapi.decisions_schema`` (the OpenAPI document's body) takes what ``parse``
    takes and refuses what it refuses: the typed items and questions, no unresolved reference."""
    import json

    import jsonschema

    from gateway.http.openapi import decisions_schema

    schema = decisions_schema()
    assert "$ref" not in json.dumps(schema)
    body = {"model": "m", "input": [{"role": "user", "content": "hi"},
                                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                                    {"type": "function_call_output", "call_id": "c", "output": "ok"}],
            "questions": [{"type": "predicate", "instructions": "Is it?"},
                          {"type": "choice", "instructions": "Which?", "choices": [{"value": "a"}, {"value": True}]},
                          {"type": "score", "instructions": [{"type": "input_text", "text": "How?"}],
                           "levels": [{"label": "low"}, {"label": "high"}]}]}
    jsonschema.validate(body, schema)
    D.parse(body)
    for bad in ({**body, "questions": [{"type": "ranking", "instructions": "?"}]},
                {**body, "questions": [{"type": "choice", "instructions": "?", "choices": [{"value": "a"}]}]},
                {**body, "temperature": 0}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
        with pytest.raises(TandemError):
            D.parse(bad)
