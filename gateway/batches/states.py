"""A batch job's status (OpenAI's Batch API statuses) and the one table of its moves.

The status column is written only by ``BatchStore.move`` (``gateway/batches/store.py``), against
``TRANSITIONS``: a move names where it goes, the table says where it may come from, and the
store checks it in the same transaction that writes it (with the runner's fence). Whoever moves
a batch (the runner, a cancel from the API) says only the target; a move the table does not
hold (a finished batch started again, a cancelled one completed) changes nothing.
"""

from __future__ import annotations

from enum import StrEnum


class BatchStatus(StrEnum):
    VALIDATING = "validating"  # created; its input file not yet read
    IN_PROGRESS = "in_progress"  # its lines being served
    FINALIZING = "finalizing"  # every line answered; the output files being written
    CANCELLING = "cancelling"  # cancelled by a client; its lines in flight finishing
    COMPLETED = "completed"
    FAILED = "failed"  # the input was refused (or writing the files failed)
    EXPIRED = "expired"  # its completion window passed first
    CANCELLED = "cancelled"

    @property
    def final(self) -> bool:
        return self in FINAL


S = BatchStatus
FINAL = frozenset({S.COMPLETED, S.FAILED, S.EXPIRED, S.CANCELLED})
ACTIVE = tuple(s for s in S if s not in FINAL)  # what a runner holds a lease on

# from -> where it may go. A final status goes nowhere; failing or expiring ends any active batch.
TRANSITIONS: dict[BatchStatus, frozenset[BatchStatus]] = {
    S.VALIDATING: frozenset({S.IN_PROGRESS, S.CANCELLING, S.FAILED, S.EXPIRED}),
    S.IN_PROGRESS: frozenset({S.FINALIZING, S.CANCELLING, S.FAILED, S.EXPIRED}),
    S.FINALIZING: frozenset({S.COMPLETED, S.FAILED, S.EXPIRED}),
    S.CANCELLING: frozenset({S.CANCELLED, S.FAILED, S.EXPIRED}),
    **{s: frozenset() for s in FINAL},
}

# The timestamp field each status sets when reached (OpenAI's batch object).
TIMESTAMPS = {s: f"{s.value}_at" for s in S if s is not S.VALIDATING}


def sources(to: BatchStatus) -> tuple[BatchStatus, ...]:
    """The statuses a batch may move to ``to`` from (``TRANSITIONS``)."""
    return tuple(s for s, targets in TRANSITIONS.items() if to in targets)


def zero_filled(counts: dict[str, int]) -> dict[str, int]:
    """Batches per status, every status present (0 where none): the metrics' gauge."""
    return {s.value: counts.get(s.value, 0) for s in S}
