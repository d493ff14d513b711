"""The diffusion worker loop with a fake runner: a failed forward fails its batch, the loop goes on."""

import asyncio

from diffusion_plugin.batch import RowOutput, StepOutput
from diffusion_plugin.loop import DiffusionLoop, EventKind
from diffusion_plugin.request import SeqStatus
from diffusion_plugin.scheduler import Scheduler
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
