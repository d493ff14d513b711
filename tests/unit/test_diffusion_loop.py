"""The diffusion worker loop with a fake runner: a failed forward fails its batch, the loop goes on."""

import asyncio

from diffusion_plugin.batcher.batch import RowOutput, StepOutput
from diffusion_plugin.batcher.loop import DiffusionLoop, EventKind
from diffusion_plugin.batcher.request import SeqStatus
from diffusion_plugin.batcher.scheduler import Scheduler
from tests.unit.diffusion_fakes import make_seq as _seq


class FakeRunner:
    def __init__(self, fail_times=0):
        self.fail_times = fail_times
        self.resets = 0
        self.freed = []

    def execute(self, batch, seqs):
        if self.fail_times:
            self.fail_times -= 1
            raise RuntimeError("forward exploded")
        return StepOutput(rows=[RowOutput(s, True, committed=[7] * 4) for s in batch.denoise], forward_s=0.001)

    def free(self, seq_id):
        self.freed.append(seq_id)

    def reset(self):
        self.resets += 1


async def _drain(queue):
    events = []
    while True:
        ev = await asyncio.wait_for(queue.get(), 5)
        events.append(ev)
        if ev.kind is EventKind.FINISHED:
            return events


def test_a_failed_forward_errors_every_member_and_the_loop_serves_on():
    async def main():
        runner = FakeRunner(fail_times=1)
        loop = DiffusionLoop(Scheduler(max_batch=4, canvas_length=4), runner)
        loop.start()
        a, b = loop.submit(_seq("a", max_tokens=4)), loop.submit(_seq("b", max_tokens=4))
        ea, eb = await _drain(a), await _drain(b)
        c = loop.submit(_seq("c", max_tokens=4))
        ec = await _drain(c)
        await loop.stop()
        return ea, eb, ec, runner

    ea, eb, ec, runner = asyncio.run(main())
    for events in (ea, eb):
        assert events[-1].seq.status is SeqStatus.FINISHED_ERROR and "forward exploded" in events[-1].seq.error
    assert runner.resets == 1
    assert [e.kind for e in ec] == [EventKind.BLOCK, EventKind.FINISHED] and ec[-1].seq.status is SeqStatus.FINISHED_LENGTH


def test_abort_of_a_waiting_request_answers_it():
    async def main():
        loop = DiffusionLoop(Scheduler(max_batch=1, canvas_length=4), FakeRunner())
        q = loop.submit(_seq("x", max_tokens=400))
        loop.abort("x")
        loop.start()
        events = await _drain(q)
        await loop.stop()
        return events

    events = asyncio.run(main())
    assert events[-1].seq.status is SeqStatus.FINISHED_ABORTED


def test_one_queue_carries_every_sequence_of_a_request():
    async def main():
        loop = DiffusionLoop(Scheduler(max_batch=4, canvas_length=4), FakeRunner())
        loop.start()
        q = loop.submit(_seq("r-0", max_tokens=4), _seq("r-1", max_tokens=8))
        events, finished = [], 0
        while finished < 2:
            ev = await asyncio.wait_for(q.get(), 5)
            events.append((ev.seq.seq_id, ev.kind))
            finished += ev.kind is EventKind.FINISHED
        await loop.stop()
        return events, loop

    events, loop = asyncio.run(main())
    assert [k for s, k in events if s == "r-0"] == [EventKind.BLOCK, EventKind.FINISHED]
    assert [k for s, k in events if s == "r-1"] == [EventKind.BLOCK, EventKind.BLOCK, EventKind.FINISHED]
    assert not loop.queues and not loop.seqs  # a finished sequence leaves no queue behind


def test_vllm_request_families_count_each_ended_sequence_once():
    """vLLM's per-request histograms on a diffusion replica: one observation per sequence that
    ended with stop/length (its TTFT is the first committed block), request_success by reason,
    vLLM's bucket bounds; an aborted sequence counts only as ``abort``."""
    from prometheus_client.parser import text_string_to_metric_families

    from diffusion_plugin.batcher.vllm_names import RequestHistograms

    async def main():
        hist = RequestHistograms(max_model_len=1024)
        loop = DiffusionLoop(Scheduler(max_batch=4, canvas_length=4), FakeRunner(), hist)
        waiting = loop.submit(_seq("w", max_tokens=400))
        loop.abort("w")
        loop.start()
        await _drain(waiting)
        events = await _drain(loop.submit(_seq("r-0", max_tokens=4)))
        events += await _drain(loop.submit(_seq("r-1", max_tokens=8)))
        await loop.stop()
        return hist, events

    hist, events = asyncio.run(main())
    seqs = {e.seq.seq_id: e.seq for e in events}
    assert all(s.arrival <= s.admitted_at <= s.first_token_at for s in seqs.values())
    samples = {(s.name, s.labels.get("le"), s.labels.get("finished_reason")): s.value
               for f in text_string_to_metric_families(hist.exposition("m")) for s in f.samples
               if s.labels["model_name"] == "m" and s.labels["engine"] == "0"}
    assert samples[("vllm:request_success_total", None, "length")] == 2
    assert samples[("vllm:request_success_total", None, "abort")] == 1
    assert samples[("vllm:request_success_total", None, "stop")] == 0
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens"):
        assert samples[(f"vllm:{name}_count", None, None)] == 2, name
        assert samples[(f"vllm:{name}_bucket", "+Inf", None)] == 2, name
    assert samples[("vllm:request_generation_tokens_sum", None, None)] == 4 + 8
    assert samples[("vllm:request_generation_tokens_bucket", "5.0", None)] == 1  # vLLM's 1-2-5 bounds
    assert samples[("vllm:request_generation_tokens_bucket", "10.0", None)] == 2
    assert samples[("vllm:time_to_first_token_seconds_bucket", "2560.0", None)] == 2


class TwoStepRunner(FakeRunner):
    """Each block takes two steps (converged: the sequences' limit is three)."""

    def __init__(self):
        super().__init__()
        self.steps: dict[str, int] = {}

    def execute(self, batch, seqs):
        rows = []
        for s in batch.denoise:
            self.steps[s] = self.steps.get(s, 0) + 1
            done = self.steps[s] % 2 == 0
            rows.append(RowOutput(s, done, committed=[7] * 4 if done else None))
        return StepOutput(rows=rows, forward_s=0.001)


def test_a_traced_sequence_has_a_prompt_span_and_one_span_per_committed_block():
    """The spans continue the context the request was submitted in (``tracing.TRACE``); an
    untraced request makes none."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from diffusion_plugin.batcher.spans import SeqSpans
    from tandem_core import tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    parent = provider.get_tracer("t").start_span("replica chat")
    carrier = tracing.carrier_of(parent)

    async def main():
        loop = DiffusionLoop(Scheduler(max_batch=4, canvas_length=4), TwoStepRunner(),
                             spans=SeqSpans(provider.get_tracer("d"), lambda seq_id: 0.0))
        loop.start()
        token = tracing.TRACE.set(carrier)
        traced = loop.submit(_seq("t", max_tokens=12))
        tracing.TRACE.reset(token)
        untraced = loop.submit(_seq("u", max_tokens=8))
        events = await _drain(traced) + await _drain(untraced)
        await loop.stop()
        return events

    events = asyncio.run(main())
    blocks = [e for e in events if e.kind is EventKind.BLOCK and e.seq.seq_id == "t"]
    spans = exporter.get_finished_spans()
    assert {s.attributes["tandem.sequence"] for s in spans} == {"t"}
    assert all(s.parent.span_id == parent.context.span_id and s.context.trace_id == parent.context.trace_id
               for s in spans)
    (prompt,) = [s for s in spans if s.name == "diffusion prompt"]
    assert prompt.attributes["gen_ai.usage.input_tokens"] == 3
    block_spans = [s for s in spans if s.name == "diffusion block"]
    assert len(block_spans) == len(blocks) == 3
    for i, s in enumerate(block_spans):
        assert s.attributes["tandem.block.index"] == i and s.attributes["tandem.block.steps"] == 2
        assert s.attributes["tandem.block.converged"] is True and s.attributes["tandem.block.tokens"] == 4
        assert [e.name for e in s.events] == ["step", "step", "converged", "commit"]
        assert s.start_time <= s.events[0].timestamp <= s.events[-1].timestamp <= s.end_time
    assert prompt.end_time <= block_spans[0].events[0].timestamp + 1
