"""The block-granular continuous batcher's decisions: admit, retire, what runs next.

Pure Python (no torch, Ray or asyncio) and unit-tested with hand-built step outputs.

Each loop iteration is ``schedule()`` -> runner executes the ``StepBatch`` -> ``update()``.
- Block mode (default): sequences join and leave at block boundaries. A boundary is a step
  at which no admitted sequence is mid-block; then finished blocks are committed (encoder
  pass) and waiting requests are admitted, up to ``max_batch``. A sequence that converged
  early is not forwarded for the rest of the block (``BLOCK_DONE``); the steps it waits are
  counted as ``row_steps_waiting``.
- Row mode: a sequence that converged commits and starts its next block at the next step,
  and a waiting request is admitted as soon as a slot is free.
- Memory (``memory.MemoryBudget``): each sequence reserves what it may hold at most (its KV
  at prompt + max_tokens + canvas, its per-row state) from admission to retirement; the head
  of the queue joins only if its reservation fits, and nobody overtakes it (FIFO: a long
  prompt is not starved by short ones). Where the KV page pool is planned (a device), the
  reservation is its pages per layer group, each against that group's pages, plus its other
  bytes against the rest of the budget: a pool never runs out mid-request. A sequence that
  cannot fit even alone is refused before it is queued (``fits_alone``, checked by the
  engine: a 400).
Aborts are drained at the top of ``schedule()``, so a cancelled sequence never reaches
another forward.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from diffusion_plugin.batcher.batch import StepBatch, StepOutput
from diffusion_plugin.batcher.memory import MemoryBudget
from diffusion_plugin.batcher.request import SeqStatus, Sequence


@dataclass
class SchedulerStats:
    steps: int = 0  # decoder forwards
    row_steps: int = 0  # rows in those forwards
    row_steps_waiting: int = 0  # converged rows idle while a slower row finished its block (block mode)
    blocks_committed: int = 0
    tokens_committed: int = 0
    prompt_tokens: int = 0  # of the sequences admitted to run (vLLM's prompt_tokens)
    tokens_scored: int = 0  # prompt tokens read in score blocks (echo, prompt_logprobs)
    encode_passes: int = 0
    aborted: int = 0
    waiting_for_memory: int = 0  # sequences queued behind a head that does not fit the budget now


@dataclass
class Finished:
    seq: Sequence


@dataclass
class Committed:
    seq: Sequence
    new_ids: list[int]
    logprobs: list | None = None  # ``RowOutput.logprobs`` of the tokens kept (None: not asked)


class Scheduler:
    def __init__(self, max_batch: int, canvas_length: int, row_boundaries: bool = False,
                 memory: MemoryBudget | None = None):
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self.max_batch = max_batch
        self.canvas_length = canvas_length
        self.row_boundaries = row_boundaries
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}
        self._aborts: list[tuple[str, SeqStatus]] = []
        self._to_free: list[str] = []
        self._done: list[Finished] = []  # finished when added (nothing to run)
        self.stats = SchedulerStats()
        self.memory = memory
        self.reserved: dict[str, int] = {}  # bytes per running sequence (against memory.rest_bytes)
        self.reserved_pages: dict[str, tuple[int, ...]] = {}  # pages per layer group per running sequence

    # -- memory -----------------------------------------------------------------------------
    def need(self, seq: Sequence) -> int:
        return self.memory.need(seq.prompt_len, seq.params.max_tokens) if self.memory else 0

    def pages(self, seq: Sequence) -> tuple[int, ...]:
        return self.memory.pages(seq.prompt_len, seq.params.max_tokens) if self.memory else ()

    def fits_alone(self, seq: Sequence) -> bool:
        return self.memory is None or self.memory.fits(self.need(seq), self.pages(seq))

    @property
    def reserved_bytes(self) -> int:
        return sum(self.reserved.values())

    @property
    def pages_reserved(self) -> tuple[int, ...]:
        """Pages reserved per layer group (``memory.groups``' order; empty when not planned)."""
        width = len(self.memory.groups) if self.memory else 0
        return tuple(sum(p[g] for p in self.reserved_pages.values()) for g in range(width))

    def _fits_now(self, seq: Sequence) -> bool:
        return self.memory is None or self.memory.fits(self.need(seq), self.pages(seq), self.reserved_bytes,
                                                       self.pages_reserved)

    # -- requests in --------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.params.max_tokens == 0 and not seq.score_ids and not seq.read_ids:  # echo alone: nothing to run
            seq.status = SeqStatus.FINISHED_LENGTH
            self._done.append(Finished(seq))
            return
        seq.status = SeqStatus.WAITING
        self.stats.prompt_tokens += seq.prompt_len
        # By priority, then arrival (vLLM's order): before the first waiting row that is less
        # urgent. Running rows are never preempted: a block ends within max_denoising_steps, and
        # the gateway's admission already lets urgent requests past a bulk queue.
        at = next((i for i, w in enumerate(self.waiting) if w.priority > seq.priority), len(self.waiting))
        self.waiting.insert(at, seq)

    def abort(self, seq_id: str, status: SeqStatus = SeqStatus.FINISHED_ABORTED) -> None:
        """Takes effect at the next ``schedule()``, before any further forward."""
        self._aborts.append((seq_id, status))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._aborts or self._to_free or self._done)

    # -- the cycle ------------------------------------------------------------------------
    def schedule(self) -> tuple[StepBatch, list[Finished]]:
        # 1. Drain aborts first: an aborted sequence leaves before the next forward.
        finished = self._drain_aborts() + self._done
        self._done = []
        batch = StepBatch(free=self._to_free)
        self._to_free = []
        # 2. At a boundary: committed blocks get their encoder pass, waiting sequences join.
        at_boundary = self.row_boundaries or not any(
            s.status is SeqStatus.DENOISING for s in self.running.values())
        if at_boundary:
            for seq in self.running.values():
                if seq.status is SeqStatus.BLOCK_DONE:
                    seq.status = SeqStatus.NEEDS_ENCODE
            while self.waiting and not self.fits_alone(self.waiting[0]):  # the engine refuses these first
                seq = self.waiting.popleft()
                seq.status, seq.error = SeqStatus.FINISHED_ERROR, "the sequence does not fit the memory budget"
                finished.append(Finished(seq))
            while self.waiting and len(self.running) < self.max_batch and self._fits_now(self.waiting[0]):
                seq = self.waiting.popleft()
                seq.status = SeqStatus.NEEDS_ENCODE
                self.running[seq.seq_id] = seq
                self.reserved[seq.seq_id] = self.need(seq)
                self.reserved_pages[seq.seq_id] = self.pages(seq)
                batch.admit.append(seq.seq_id)
            blocked = bool(self.waiting) and len(self.running) < self.max_batch
            self.stats.waiting_for_memory = len(self.waiting) if blocked else 0
        # 3. Encoder passes, then every sequence mid-block is a row of the decoder forward.
        for seq in self.running.values():
            if seq.status is SeqStatus.NEEDS_ENCODE:
                batch.encode.append(seq.seq_id)
                seq.status = SeqStatus.DENOISING
                seq.step = 0
        batch.denoise = [s.seq_id for s in self.running.values() if s.status is SeqStatus.DENOISING]
        waiting_rows = sum(1 for s in self.running.values() if s.status is SeqStatus.BLOCK_DONE)
        if batch.denoise:
            self.stats.steps += 1
            self.stats.row_steps += len(batch.denoise)
            self.stats.row_steps_waiting += waiting_rows
        self.stats.encode_passes += len(batch.encode)
        return batch, finished

    def update(self, out: StepOutput) -> tuple[list[Committed], list[Finished]]:
        """Apply the runner's results. Rows of sequences aborted meanwhile are skipped."""
        committed, finished = [], []
        for seq_id, tokens in out.cached.items():
            if seq_id in self.running:
                self.running[seq_id].cached_tokens = tokens
        for row in out.rows:
            seq = self.running.get(row.seq_id)
            if seq is None or seq.status is not SeqStatus.DENOISING:
                continue  # aborted or already finished: skip, do not crash
            seq.step += 1
            if not row.block_done:
                continue
            if seq.block < seq.score_blocks(self.canvas_length):  # a score block: prompt tokens read
                status = self._scored(seq, row)
                if status is not None:
                    finished.append(self._retire(seq, status))
                else:
                    seq.status = SeqStatus.NEEDS_ENCODE if self.row_boundaries else SeqStatus.BLOCK_DONE
                continue
            new_ids, status = self._commit(seq, row.committed or [])
            committed.append(Committed(seq, new_ids, row.logprobs[:len(new_ids)] if row.logprobs else None))
            if status is not None:
                finished.append(self._retire(seq, status))
            else:
                seq.status = SeqStatus.NEEDS_ENCODE if self.row_boundaries else SeqStatus.BLOCK_DONE
        return committed, finished

    def fail(self, seq_ids: list[str], error: str) -> list[Finished]:
        """A batch failed: every sequence in it ends with an error and its state is dropped."""
        out = []
        for seq_id in seq_ids:
            seq = self.running.get(seq_id)
            if seq is not None:
                seq.error = error
                out.append(self._retire(seq, SeqStatus.FINISHED_ERROR))
        return out

    # -- helpers --------------------------------------------------------------------------
    def _commit(self, seq: Sequence, block: list[int]) -> tuple[list[int], SeqStatus | None]:
        eos = set(seq.params.eos_token_ids)
        cut = next((i for i, t in enumerate(block) if t in eos), None)
        room = seq.params.max_tokens - len(seq.output_ids)
        new_ids = block[:cut] if cut is not None else list(block)
        status = SeqStatus.FINISHED_STOPPED if cut is not None else None
        if len(new_ids) >= room:
            if len(new_ids) > room or status is None:
                status = SeqStatus.FINISHED_LENGTH
            new_ids = new_ids[:room]
        seq.output_ids.extend(new_ids)
        seq.block += 1
        self.stats.blocks_committed += 1
        self.stats.tokens_committed += len(new_ids)
        return new_ids, status

    def _scored(self, seq: Sequence, row) -> SeqStatus | None:
        """A score block's read: its tokens' scores recorded (not output); with ``max_tokens`` 0 the
        last one ends the sequence."""
        plan = seq.plan(self.canvas_length)
        if plan.reads:  # a label read: one score per candidate, no prompt token scored
            seq.scores.extend(row.scores)
        else:
            seq.scores.extend(row.scores[:len(plan.seed)])
            self.stats.tokens_scored += len(plan.seed)
        seq.block += 1
        if seq.block == seq.score_blocks(self.canvas_length) and seq.params.max_tokens == 0:
            return SeqStatus.FINISHED_LENGTH
        return None

    def _retire(self, seq: Sequence, status: SeqStatus) -> Finished:
        seq.status = status
        self.running.pop(seq.seq_id, None)
        self.reserved.pop(seq.seq_id, None)
        self.reserved_pages.pop(seq.seq_id, None)
        self._to_free.append(seq.seq_id)
        return Finished(seq)

    def _drain_aborts(self) -> list[Finished]:
        finished = []
        for seq_id, status in self._aborts:
            seq = self.running.get(seq_id)
            if seq is not None:
                finished.append(self._retire(seq, status))
            else:
                for i, w in enumerate(self.waiting):
                    if w.seq_id == seq_id:
                        del self.waiting[i]
                        w.status = status
                        finished.append(Finished(w))
                        break
            if status is SeqStatus.FINISHED_ABORTED and finished and finished[-1].seq.seq_id == seq_id:
                self.stats.aborted += 1
        self._aborts = []
        return finished
