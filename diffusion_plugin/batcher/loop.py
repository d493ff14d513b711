"""The worker loop: one task owns the model. schedule -> execute (in a thread) -> update.

Requests talk to it through ``submit``/``abort``; a request's sequences (its ``n`` choices)
share one queue of ``SeqEvent``s, in the order the loop emitted them. Each sequence's last event
is ``FINISHED``. A failed step fails every sequence of that batch (and resets the runner); the
loop goes on.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass, field

from diffusion_plugin.batcher.request import SeqStatus, Sequence
from diffusion_plugin.batcher.scheduler import Scheduler
from tandem_core.tracing import TRACE

logger = logging.getLogger(__name__)


class EventKind(enum.Enum):
    PREVIEW = "preview"  # the block's argmax canvas after a step (sequences that asked for previews)
    BLOCK = "block"  # a block committed: ``new_ids`` (and ``logprobs`` if asked)
    FINISHED = "finished"  # the sequence's last event; ``seq.status`` says how it ended


@dataclass
class SeqEvent:
    kind: EventKind
    seq: Sequence
    new_ids: list[int] = field(default_factory=list)
    step: int = 0  # PREVIEW: the step just run (1-based)
    logprobs: list | None = None  # BLOCK: ``Committed.logprobs``


@dataclass
class LoopStats:
    forward_s: float = 0.0
    busy_s: float = 0.0  # wall time spent in execute() calls
    admitted: int = 0
    admission_wait_sum_s: float = 0.0
    block_seconds: float = 0.0
    errors: int = 0


class DiffusionLoop:
    def __init__(self, scheduler: Scheduler, runner, requests=None, spans=None):
        """``requests``: a ``vllm_names.RequestHistograms`` told of each sequence that ends;
        ``spans``: a ``spans.SeqSpans`` told of each step, commit and end (None: untraced)."""
        self.scheduler = scheduler
        self.requests = requests
        self.spans = spans
        self.runner = runner
        self.seqs: dict[str, Sequence] = {}
        self.queues: dict[str, asyncio.Queue] = {}
        self.stats = LoopStats()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.dead: BaseException | None = None
        self._resets: list[asyncio.Future] = []  # prefix-cache resets, done between steps

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="diffusion-loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def submit(self, *seqs: Sequence) -> asyncio.Queue:
        """Queue one request's sequences; returns the one queue all their events arrive on."""
        if self.dead is not None:
            raise RuntimeError(f"the diffusion loop died: {self.dead!r}")
        queue: asyncio.Queue = asyncio.Queue()
        now = time.monotonic()
        trace = TRACE.get() if self.spans is not None else None  # (the submitting request's task)
        for seq in seqs:
            seq.arrival, seq.trace = now, trace
            self.seqs[seq.seq_id] = seq
            self.queues[seq.seq_id] = queue
            self.scheduler.add(seq)
        self._wake.set()
        return queue

    async def reset_prefix_cache(self) -> bool:
        """The runner's prefix cache reset between two steps (the loop owns the runner's pool)."""
        if self.dead is not None:
            raise RuntimeError(f"the diffusion loop died: {self.dead!r}")
        done = asyncio.get_running_loop().create_future()
        self._resets.append(done)
        self._wake.set()
        return await done

    def _reset_prefix_cache(self) -> None:
        resets, self._resets = self._resets, []
        reset = getattr(self.runner, "reset_prefix_cache", None)
        ok = reset() if reset is not None else True
        for done in resets:
            if not done.done():
                done.set_result(ok)

    def abort(self, seq_id: str, status: SeqStatus = SeqStatus.FINISHED_ABORTED) -> None:
        if seq_id in self.seqs:
            self.scheduler.abort(seq_id, status)
            self._wake.set()

    def _emit(self, event: SeqEvent) -> None:
        queue = self.queues.get(event.seq.seq_id)
        if queue is not None:
            queue.put_nowait(event)
        if event.kind is EventKind.FINISHED:
            if self.requests is not None:
                self.requests.finished(event.seq, time.monotonic())
            if self.spans is not None:
                self.spans.finished(event.seq)
            self.queues.pop(event.seq.seq_id, None)
            self.seqs.pop(event.seq.seq_id, None)

    async def _run(self) -> None:
        try:
            while True:
                if not self.scheduler.has_work() and not self._resets:
                    self._wake.clear()
                    await self._wake.wait()
                if self._resets:
                    self._reset_prefix_cache()
                # 1. schedule (aborts drained first)
                batch, finished = self.scheduler.schedule()
                for f in finished:
                    self._emit(SeqEvent(EventKind.FINISHED, f.seq))
                now = time.monotonic()
                for seq_id in batch.admit:
                    seq = self.seqs[seq_id]
                    seq.admitted_at = seq.block_started = now
                    self.stats.admitted += 1
                    self.stats.admission_wait_sum_s += now - seq.arrival
                if batch.empty():
                    for seq_id in batch.free:
                        self.runner.free(seq_id)
                    await asyncio.sleep(0)
                    continue
                # 2. execute, off the event loop
                try:
                    out = await asyncio.to_thread(self.runner.execute, batch, dict(self.seqs))
                except Exception as e:  # noqa: BLE001 - fail this batch, keep serving
                    logger.exception("diffusion step failed; failing its %d sequences", len(self.scheduler.running))
                    self.stats.errors += 1
                    self.runner.reset()
                    for f in self.scheduler.fail(list(self.scheduler.running), f"{type(e).__name__}: {e}"):
                        self._emit(SeqEvent(EventKind.FINISHED, f.seq))
                    continue
                self.stats.forward_s += out.forward_s
                self.stats.busy_s += out.step_s
                # 3. update, then tell each request what happened to it
                stepped_at = time.monotonic()
                for row in out.rows:
                    seq = self.seqs.get(row.seq_id)
                    if self.spans is not None and seq is not None:
                        self.spans.stepped(seq, stepped_at)
                    if row.preview is not None and seq is not None and not row.block_done:
                        self._emit(SeqEvent(EventKind.PREVIEW, seq, row.preview, step=seq.step + 1))
                committed, finished = self.scheduler.update(out)
                done_at = time.monotonic()
                for c in committed:
                    if self.spans is not None:
                        self.spans.committed(c.seq, c.new_ids, done_at, c.seq.params.max_denoising_steps)
                    self.stats.block_seconds += done_at - c.seq.block_started
                    c.seq.block_started = done_at
                    if c.new_ids and c.seq.first_token_at is None:
                        c.seq.first_token_at = done_at
                    self._emit(SeqEvent(EventKind.BLOCK, c.seq, c.new_ids, logprobs=c.logprobs))
                for f in finished:
                    self._emit(SeqEvent(EventKind.FINISHED, f.seq))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - this is a bug; end every waiter, never hang
            logger.exception("bug: the diffusion loop crashed")
            self.dead = e
            for done in self._resets:
                if not done.done():
                    done.set_exception(RuntimeError(f"the diffusion loop crashed: {e!r}"))
            for seq in list(self.seqs.values()):
                seq.status, seq.error = SeqStatus.FINISHED_ERROR, f"the diffusion loop crashed: {e!r}"
                self._emit(SeqEvent(EventKind.FINISHED, seq))
            raise

