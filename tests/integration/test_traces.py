"""One trace per request, from the gateway into the engine, on the real stack (its config sends
traces to an in-process OTLP/HTTP receiver, ``tests/otlp_receiver.py``): the gateway's span
continues the client's ``traceparent`` (or starts a trace), its attempt's context crosses the
Ray hop, the replica's span continues it, and the engine's own spans are the replica span's
children: vLLM's ``llm_request`` on tiny-llama, the prompt pass and one span per committed block
on tiny-diffusiongemma."""

from __future__ import annotations

import secrets

from tests.waiting import wait_for

FAST = {"diffusion": {"max_denoising_steps": 4}}


def _traceparent() -> tuple[str, str]:
    trace_id = secrets.token_hex(16)
    return trace_id, f"00-{trace_id}-{secrets.token_hex(8)}-01"


def _one(spans, name):
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [s.name for s in spans])
    return found[0]


def _stream(stack, model: str, traceparent: str, **kw):
    chunks = list(stack.client().chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Tell me about trees."}], stream=True,
        stream_options={"include_usage": True}, extra_headers={"traceparent": traceparent}, **kw))
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    (response_id,) = {c.id for c in chunks}
    return chunks[-1].usage, reasons, response_id


def _check_gateway_span(request, answer, model: str, parent: str):
    usage, reasons, response_id = answer
    a = request.attributes
    assert request.parent_id == parent and request.kind == 2  # SERVER, under the client's span
    assert (a["gen_ai.operation.name"], a["gen_ai.request.model"], a["gen_ai.request.stream"]) == ("chat", model, True)
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (usage.prompt_tokens,
                                                                                  usage.completion_tokens)
    assert a["gen_ai.response.finish_reasons"] == reasons and a["gen_ai.response.time_to_first_chunk"] > 0
    assert a["gen_ai.response.id"] == response_id


def test_a_streamed_chat_on_vllm_is_one_trace_down_to_vllms_llm_request(stack, otlp):
    trace_id, traceparent = _traceparent()
    answer = _stream(stack, "tiny-llama", traceparent, max_tokens=12)
    usage = answer[0]
    names = {"chat tiny-llama", "admission", "attempt", "replica chat", "llm_request"}
    wait_for(lambda: names <= {s.name for s in otlp.trace(trace_id)}, f"the spans {names} of trace {trace_id}",
             timeout=60)
    spans = otlp.trace(trace_id)
    request, attempt = _one(spans, "chat tiny-llama"), _one(spans, "attempt")
    replica, engine = _one(spans, "replica chat"), _one(spans, "llm_request")
    _check_gateway_span(request, answer, "tiny-llama", traceparent.split("-")[2])
    assert _one(spans, "admission").parent_id == attempt.parent_id == request.span_id
    assert replica.parent_id == attempt.span_id and replica.attributes["tandem.replica.id"] == "tiny-llama/0"
    assert engine.parent_id == replica.span_id  # vLLM's own span, fed the propagated context
    assert engine.attributes["gen_ai.usage.completion_tokens"] == usage.completion_tokens
    assert request.start_ns <= attempt.start_ns <= replica.start_ns <= engine.start_ns
    assert {s.service for s in (request, replica)} == {"tandem", "tandem-replica"}


def test_a_streamed_chat_on_diffusion_has_a_span_per_committed_block(stack, otlp):
    def blocks() -> int:
        return stack.replica_stats("tiny-diffusiongemma")[0]["engine"]["blocks_committed"]

    before = blocks()
    trace_id, traceparent = _traceparent()
    answer = _stream(stack, "tiny-diffusiongemma", traceparent, max_tokens=70, extra_body=FAST)
    usage = answer[0]
    wait_for(lambda: blocks() > before, "the replica's stats to count the blocks committed", timeout=30)
    committed = blocks() - before
    wait_for(lambda: sum(s.name == "diffusion block" for s in otlp.trace(trace_id)) >= committed and
             {"chat tiny-diffusiongemma", "attempt", "replica chat", "diffusion prompt"} <= {
                 s.name for s in otlp.trace(trace_id)}, f"trace {trace_id}'s spans", timeout=60)
    spans = otlp.trace(trace_id)
    request, attempt, replica = _one(spans, "chat tiny-diffusiongemma"), _one(spans, "attempt"), _one(spans,
                                                                                                      "replica chat")
    _check_gateway_span(request, answer, "tiny-diffusiongemma", traceparent.split("-")[2])
    assert request.attributes["gen_ai.provider.name"] == "tandem"
    assert attempt.parent_id == request.span_id and replica.parent_id == attempt.span_id
    prompt = _one(spans, "diffusion prompt")
    block_spans = sorted((s for s in spans if s.name == "diffusion block"), key=lambda s: s.start_ns)
    assert len(block_spans) == committed  # one span per block committed, no more
    assert prompt.parent_id == replica.span_id and all(s.parent_id == replica.span_id for s in block_spans)
    assert prompt.attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert [s.attributes["tandem.block.index"] for s in block_spans] == list(range(committed))
    assert sum(s.attributes["tandem.block.tokens"] for s in block_spans) == usage.completion_tokens
    for s in block_spans:
        steps = s.attributes["tandem.block.steps"]
        assert 1 <= steps <= 4 and s.events.count("step") == steps and s.events[-1] == "commit"
        assert ("converged" in s.events) == s.attributes["tandem.block.converged"] == (steps < 4)


def test_a_completion_without_traceparent_starts_a_trace(stack, otlp):
    r = stack.client().completions.create(model="tiny-llama", prompt="Once upon a time", max_tokens=5)

    def root():
        return [s for s in otlp.spans if s.name == "text_completion tiny-llama" and
                s.attributes.get("gen_ai.response.id") == r.id]

    wait_for(root, f"the span of completion {r.id}", timeout=60)
    (request,) = root()
    assert request.parent_id == "" and request.attributes["gen_ai.operation.name"] == "text_completion"
    names = {"text_completion tiny-llama", "admission", "attempt", "replica completions", "llm_request"}
    # (each process exports on its own schedule: wait for all, then check nothing else came)
    wait_for(lambda: names <= {s.name for s in otlp.trace(request.trace_id)}, f"the spans {names}", timeout=60)
    assert sorted(s.name for s in otlp.trace(request.trace_id)) == sorted(names)
