"""The durable state of the Files and Batch API: one SQLite database (WAL) and a folder of files
under ``batches.data_dir``. Pure: no asyncio, no HTTP; every method is one short transaction.

Tables:
- ``files``: every file (uploaded inputs, produced outputs and errors); its bytes are
  ``files/<id>`` in the data dir, written before its row (a row always has its bytes).
- ``batches``: one row per batch: its status and the timestamp of each status it reached, its
  owner (the gateway process running it) and the owner's lease.
- ``lines``: one row per input line: ``pending`` until its answer is stored, then ``done`` (an
  answer for the output file) or ``failed`` (one for the error file), with its usage.

Nothing is lost or done twice across a crash (SIGKILL): a line's answer and its state change in
one transaction, so a line is either pending (it runs again) or answered (it never runs again),
and the output and error files are written once, from the stored answers, when the batch ends.

Ownership (several gateway processes, or a restart): a process runs a batch while it holds its
lease (``owner``, ``lease_until``); it renews the lease every poll. A lease that lapsed (its
process died or stalled) is taken by the next process that polls: ``BEGIN IMMEDIATE`` makes the
take one writer's, and each take raises the batch's ``epoch``. The epoch fences a runner that lost
its lease (a process stopped past it, then resumed): a line's answer and the runner's status moves
are stored only while (owner, epoch) still holds, checked in the same transaction (compare and
set), so exactly one process's answer is kept for each line. WAL lets every process read meanwhile.

A batch is finalized only when none of its lines is pending (``move(..., answered=True)``, in the
transaction of the move): a runner that stopped early (a drain, a lost lease) never ends a batch
with lines unanswered.

Thread-safe: one connection, every call under one lock, so a runner can call the store from a
worker thread (off its event loop) while the routes call it too.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from gateway.batches.states import ACTIVE, TIMESTAMPS, BatchStatus, sources, zero_filled

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL, bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL, expires_at INTEGER, tenant TEXT);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, tenant TEXT, key TEXT, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL, metadata TEXT, output_expires_s INTEGER, status TEXT NOT NULL,
    created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL, in_progress_at INTEGER, finalizing_at INTEGER,
    completed_at INTEGER, failed_at INTEGER, expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
    output_file_id TEXT, error_file_id TEXT, errors TEXT, model TEXT, owner TEXT, lease_until REAL,
    epoch INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT, request TEXT, state TEXT NOT NULL,
    answer TEXT, input_tokens INTEGER DEFAULT 0, cached_tokens INTEGER DEFAULT 0,
    output_tokens INTEGER DEFAULT 0, reasoning_tokens INTEGER DEFAULT 0, PRIMARY KEY (batch_id, idx));
CREATE INDEX IF NOT EXISTS lines_pending ON lines (batch_id, state);
"""


Fence = tuple[str, int]  # (owner, epoch): a runner's hold on one batch


def _locked(method):
    """Run ``method`` under the store's lock (one connection, used from several threads)."""
    import functools

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return wrapper


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class Line:
    idx: int
    custom_id: str | None
    request: dict | None  # the validated line ({custom_id, method, url, body}); None: it failed validation
    answer: dict | None = None  # the output line, once answered


class BatchStore:
    def __init__(self, data_dir: Path | str):
        self.dir = Path(data_dir)
        (self.dir / "files").mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.dir / "tandem.db", timeout=30, isolation_level=None,
                                  check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")  # durable across a process crash (not power loss)
        self.db.executescript(SCHEMA)
        columns = {r["name"] for r in self.db.execute("PRAGMA table_info(batches)")}
        if "epoch" not in columns:  # a data dir of an earlier tandem
            self.db.execute("ALTER TABLE batches ADD COLUMN epoch INTEGER NOT NULL DEFAULT 0")
        self._lock = threading.RLock()

    @_locked
    def close(self) -> None:
        self.db.close()

    def _write(self):
        """One writer's transaction (``with store._write():``), under the lock."""
        return _Immediate(self.db, self._lock)

    # -- files ---------------------------------------------------------------------------------------
    @_locked
    def file_path(self, file_id: str) -> Path:
        return self.dir / "files" / file_id

    @_locked
    def add_file(self, data: bytes, purpose: str, filename: str, tenant: str | None,
                 expires_at: int | None = None, file_id: str | None = None) -> dict:
        file_id = file_id or new_id("file")
        path = self.file_path(file_id)
        tmp = path.with_suffix(".part")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # the bytes before the row: a row always has its bytes
        now = int(time.time())
        with self._write():
            self.db.execute("INSERT OR REPLACE INTO files VALUES (?,?,?,?,?,?,?)",
                            (file_id, purpose, filename, len(data), now, expires_at, tenant))
        return self.file(file_id)

    @_locked
    def file(self, file_id: str) -> dict | None:
        row = self.db.execute("SELECT * FROM files WHERE id=?", (file_id,)).fetchone()
        return dict(row) if row is not None else None

    @_locked
    def files(self, purpose: str | None = None) -> list[dict]:
        q, args = "SELECT * FROM files", ()
        if purpose is not None:
            q, args = q + " WHERE purpose=?", (purpose,)
        return [dict(r) for r in self.db.execute(q + " ORDER BY created_at, id", args)]

    @_locked
    def delete_file(self, file_id: str) -> bool:
        with self._write():
            gone = self.db.execute("DELETE FROM files WHERE id=?", (file_id,)).rowcount > 0
        if gone:
            self.file_path(file_id).unlink(missing_ok=True)
        return gone

    @_locked
    def expired_files(self, now: float) -> list[str]:
        return [r["id"] for r in self.db.execute(
            "SELECT id FROM files WHERE expires_at IS NOT NULL AND expires_at <= ?", (now,))]

    # -- batches -------------------------------------------------------------------------------------
    @_locked
    def add_batch(self, *, endpoint: str, input_file_id: str, completion_window: str, window_s: int,
                  metadata: dict | None, output_expires_s: int | None, tenant: str | None, key: str | None) -> dict:
        batch_id = new_id("batch")
        now = int(time.time())
        with self._write():
            self.db.execute(
                "INSERT INTO batches (id, tenant, key, endpoint, input_file_id, completion_window, metadata, "
                "output_expires_s, status, created_at, expires_at) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (batch_id, tenant, key, endpoint, input_file_id, completion_window,
                 json.dumps(metadata) if metadata is not None else None, output_expires_s,
                 BatchStatus.VALIDATING.value, now, now + window_s))
        return self.batch(batch_id)

    @_locked
    def batch(self, batch_id: str) -> dict | None:
        row = self.db.execute("SELECT * FROM batches WHERE id=?", (batch_id,)).fetchone()
        return dict(row) if row is not None else None

    @_locked
    def batches(self) -> list[dict]:
        return [dict(r) for r in self.db.execute("SELECT * FROM batches ORDER BY created_at DESC, rowid DESC")]

    @_locked
    def move(self, batch_id: str, status: BatchStatus, fence: Fence | None = None, answered: bool = False,
             **fields) -> bool:
        """The one writer of a batch's status: set it (and its timestamp, and ``fields``) if the
        batch is in a status ``TRANSITIONS`` lets it leave for ``status``, and (``fence``) its
        runner still holds it, and (``answered``) no line of it is pending. False: nothing moved."""
        status = BatchStatus(status)
        sets = {"status": status.value, **fields}
        if status in TIMESTAMPS:
            sets[TIMESTAMPS[status]] = int(time.time())
        only = sources(status)
        where, args = f"id=? AND status IN ({','.join('?' * len(only))})", [batch_id, *only]
        if fence is not None:
            where, args = where + " AND owner=? AND epoch=?", [*args, *fence]
        if answered:
            where += " AND NOT EXISTS (SELECT 1 FROM lines WHERE batch_id=batches.id AND state='pending')"
        with self._write():
            return self.db.execute(f"UPDATE batches SET {', '.join(f'{k}=?' for k in sets)} WHERE {where}",
                                   (*sets.values(), *args)).rowcount > 0

    @_locked
    def claim(self, owner: str, lease_s: float, now: float | None = None, take: bool = True) -> dict[str, int]:
        """The active batches ``owner`` runs from now on, each with its epoch: the ones it holds
        (lease renewed) and (``take``) any whose lease lapsed or that nobody holds yet (taken: a
        new epoch). A process that stops taking (a drain) still renews what it holds."""
        now = time.time() if now is None else now
        active = f"status IN ({','.join('?' * len(ACTIVE))})"
        with self._write():
            self.db.execute(f"UPDATE batches SET lease_until=? WHERE {active} AND owner=?",
                            (now + lease_s, *ACTIVE, owner))
            if take:
                self.db.execute(f"UPDATE batches SET owner=?, lease_until=?, epoch=epoch+1 WHERE {active} "
                                "AND (owner IS NULL OR (owner<>? AND lease_until < ?))",
                                (owner, now + lease_s, *ACTIVE, owner, now))
            return {r["id"]: r["epoch"] for r in self.db.execute(
                f"SELECT id, epoch FROM batches WHERE owner=? AND {active} ORDER BY created_at, rowid",
                (owner, *ACTIVE))}

    @_locked
    def held_status(self, batch_id: str, fence: Fence, now: float | None = None) -> str | None:
        """The batch's status if the runner of ``fence`` still holds it (as ``holds``), else None:
        one read for a runner's check before each line."""
        now = time.time() if now is None else now
        row = self.db.execute("SELECT status FROM batches WHERE id=? AND owner=? AND epoch=? AND lease_until >= ?",
                              (batch_id, *fence, now)).fetchone()
        return row["status"] if row is not None else None

    @_locked
    def holds(self, batch_id: str, fence: Fence, now: float | None = None) -> bool:
        """Whether the runner of ``fence`` still holds the batch: its owner and epoch, and a lease
        not lapsed (a runner that stalled past it stops, even before another takes the batch)."""
        now = time.time() if now is None else now
        return self.db.execute("SELECT 1 FROM batches WHERE id=? AND owner=? AND epoch=? AND lease_until >= ?",
                               (batch_id, *fence, now)).fetchone() is not None

    @_locked
    def release(self, owner: str) -> None:
        """A process that stops (drained) lets another take its batches at once."""
        with self._write():
            self.db.execute("UPDATE batches SET owner=NULL, lease_until=NULL WHERE owner=?", (owner,))

    # -- lines ---------------------------------------------------------------------------------------
    @_locked
    def add_lines(self, batch_id: str, lines: list[Line], model: str | None) -> None:
        """The validated input, once (a batch that already has lines keeps them: resumed)."""
        with self._write():
            if self.db.execute("SELECT 1 FROM lines WHERE batch_id=? LIMIT 1", (batch_id,)).fetchone():
                return
            self.db.executemany(
                "INSERT INTO lines (batch_id, idx, custom_id, request, state, answer) VALUES (?,?,?,?,?,?)",
                [(batch_id, ln.idx, ln.custom_id, json.dumps(ln.request) if ln.request is not None else None,
                  "pending" if ln.answer is None else "failed",
                  json.dumps(ln.answer) if ln.answer is not None else None) for ln in lines])
            self.db.execute("UPDATE batches SET model=? WHERE id=?", (model, batch_id))

    @_locked
    def has_lines(self, batch_id: str) -> bool:
        return self.db.execute("SELECT 1 FROM lines WHERE batch_id=? LIMIT 1", (batch_id,)).fetchone() is not None

    @_locked
    def pending(self, batch_id: str) -> list[Line]:
        return [Line(r["idx"], r["custom_id"], json.loads(r["request"])) for r in self.db.execute(
            "SELECT idx, custom_id, request FROM lines WHERE batch_id=? AND state='pending' ORDER BY idx",
            (batch_id,))]

    @_locked
    def answer(self, batch_id: str, idx: int, answer: dict, ok: bool, usage: dict | None = None,
               fence: Fence | None = None) -> bool:
        """Store a line's answer, if it is still pending (one answer per line, ever) and (``fence``)
        its runner still holds the batch: False, nothing stored, otherwise."""
        u = _usage_counts(usage)
        held, args = "", ()
        if fence is not None:
            held, args = " AND EXISTS (SELECT 1 FROM batches WHERE id=? AND owner=? AND epoch=?)", (batch_id, *fence)
        with self._write():
            return self.db.execute(
                "UPDATE lines SET state=?, answer=?, input_tokens=?, cached_tokens=?, output_tokens=?, "
                f"reasoning_tokens=? WHERE batch_id=? AND idx=? AND state='pending'{held}",
                ("done" if ok else "failed", json.dumps(answer), *u, batch_id, idx, *args)).rowcount > 0

    @_locked
    def counts(self, batch_id: str) -> dict:
        """``request_counts`` and ``usage`` as OpenAI's Batch object has them."""
        r = self.db.execute(
            "SELECT COUNT(*) AS total, SUM(state='done') AS completed, SUM(state='failed') AS failed, "
            "SUM(input_tokens) AS i, SUM(cached_tokens) AS c, SUM(output_tokens) AS o, SUM(reasoning_tokens) AS r "
            "FROM lines WHERE batch_id=?", (batch_id,)).fetchone()
        i, o = r["i"] or 0, r["o"] or 0
        return {"request_counts": {"total": r["total"], "completed": r["completed"] or 0, "failed": r["failed"] or 0},
                "usage": {"input_tokens": i, "input_tokens_details": {"cached_tokens": r["c"] or 0},
                          "output_tokens": o, "output_tokens_details": {"reasoning_tokens": r["r"] or 0},
                          "total_tokens": i + o}}

    @_locked
    def answers(self, batch_id: str, state: str) -> list[dict]:
        return [json.loads(r["answer"]) for r in self.db.execute(
            "SELECT answer FROM lines WHERE batch_id=? AND state=? ORDER BY idx", (batch_id, state))]

    @_locked
    def states(self) -> dict[str, int]:
        """Batches per status, every status named (0 where none): for the metrics."""
        rows = self.db.execute("SELECT status, COUNT(*) AS n FROM batches GROUP BY status")
        return zero_filled({r["status"]: r["n"] for r in rows})

    @_locked
    def oldest_active(self) -> int | None:
        r = self.db.execute(f"SELECT MIN(created_at) AS t FROM batches WHERE status IN "
                            f"({','.join('?' * len(ACTIVE))})", ACTIVE).fetchone()
        return r["t"]


def _usage_counts(usage: dict | None) -> tuple[int, int, int, int]:
    """(input, cached, output, reasoning) tokens of an answer's ``usage`` (chat/completions or
    responses names)."""
    if not isinstance(usage, dict):
        return 0, 0, 0, 0
    prompt = usage.get("prompt_tokens", usage.get("input_tokens")) or 0
    output = usage.get("completion_tokens", usage.get("output_tokens")) or 0
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    out_details = usage.get("completion_tokens_details") or usage.get("output_tokens_details") or {}
    return (int(prompt), int(details.get("cached_tokens") or 0), int(output),
            int(out_details.get("reasoning_tokens") or 0))


class _Immediate:
    """``BEGIN IMMEDIATE`` ... ``COMMIT`` (``ROLLBACK`` on an error): the write lock taken first,
    so two processes' read-then-write never interleave (and, under ``lock``, two threads')."""

    def __init__(self, db: sqlite3.Connection, lock: threading.RLock):
        self.db, self.lock = db, lock

    def __enter__(self):
        self.lock.acquire()
        try:
            self.db.execute("BEGIN IMMEDIATE")
        except BaseException:
            self.lock.release()
            raise
        return self.db

    def __exit__(self, exc_type, exc, tb):
        try:
            self.db.execute("ROLLBACK" if exc_type is not None else "COMMIT")
        finally:
            self.lock.release()
        return False
