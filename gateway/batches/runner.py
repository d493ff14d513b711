"""Running the batches this gateway process holds the lease of (``gateway/batches/api.py`` answers
the routes; ``gateway/batches/store.py`` keeps every state durable). Steps and rules: see
``gateway/batches/api.py``'s docstring."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from gateway.batches.states import BatchStatus as S
from gateway.batches.store import BatchStore, Fence, Line
from gateway.request.envelope import envelope
from gateway.serving.serve import serve
from tandem_core.errors import ErrorKind, TandemError

logger = logging.getLogger(__name__)

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/responses": "responses",
             "/v1/embeddings": "embeddings"}
# Failures of capacity or of a replica, not of the line: it runs again (until the batch expires).
TRANSIENT = frozenset({ErrorKind.OVERLOADED, ErrorKind.NO_REPLICA, ErrorKind.ENGINE_DEAD, ErrorKind.QUEUE_TIMEOUT})


class BatchRunner:
    """Runs the batches this process holds (one task per batch). Every store call runs on one
    worker thread (``_db``), never on the event loop: a slow disk or a locked database stalls
    neither the requests nor the lease's renewal. Each batch is held under a fence (owner,
    epoch): the lease is renewed every ``poll_s``; a batch whose lease this process lost (it
    stalled past ``lease_s``, and another took it) is stopped at once, and no answer of it is
    stored after (``BatchStore.answer`` checks the fence in its transaction)."""

    def __init__(self, service, store: BatchStore, keys: dict):
        self.service = service
        self.config = service.config.batches
        self.store = store
        self.keys = keys  # API key name -> ``ResolvedKey``: a batch runs as the key that created it
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.running: dict[str, asyncio.Task] = {}
        self.fences: dict[str, Fence] = {}  # batch -> the (owner, epoch) its task runs under
        self.stopping = False  # a drain: no batch or line is started any more
        self._loop_task: asyncio.Task | None = None
        self._io = ThreadPoolExecutor(1, thread_name_prefix="batch-store")
        self.wake = asyncio.Event()

    async def _db(self, method, *args, **kwargs):
        """``method(*args, **kwargs)`` of the store, on the store's worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self._io, partial(method, *args, **kwargs))

    # -- the runner's life ---------------------------------------------------------------------------
    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._poll_loop())

    def drain(self) -> None:
        """The process drains (SIGTERM): start no batch and no line; the lines in flight finish
        (they are in-flight requests, which the drain waits for); the rest stay pending."""
        self.stopping = True
        self.wake.set()

    async def stop(self) -> None:
        """Stop running (the batches' pending lines stay pending) and let another process take over."""
        self.stopping = True
        tasks = [t for t in (self._loop_task, *self.running.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._db(self.store.release, self.owner)
        self._io.shutdown(wait=True)

    async def _poll_loop(self) -> None:
        while True:
            try:
                held = await self._db(self.store.claim, self.owner, self.config.lease_s, take=not self.stopping)
                for batch_id, task in list(self.running.items()):
                    if held.get(batch_id) != self.fences[batch_id][1]:  # taken over: stop at once
                        logger.warning("batch %s: this process lost its lease; stopping it", batch_id)
                        task.cancel()
                for batch_id, epoch in held.items():
                    if batch_id not in self.running and not self.stopping:
                        self._start_batch(batch_id, (self.owner, epoch))
                for file_id in await self._db(self.store.expired_files, time.time()):
                    await self._db(self.store.delete_file, file_id)
                self.service.metrics.set_batches(await self._db(self.store.states),
                                                 await self._db(self.store.oldest_active))
            except Exception:  # noqa: BLE001 - the loop must go on (a locked database, a full disk)
                logger.exception("batch runner: poll failed")
            self.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), self.config.poll_s)

    def _start_batch(self, batch_id: str, fence: Fence) -> None:
        task = asyncio.create_task(self._run(batch_id, fence))
        self.running[batch_id], self.fences[batch_id] = task, fence

        def done(_t, b=batch_id):
            if self.running.get(b) is task:
                del self.running[b], self.fences[b]
        task.add_done_callback(done)

    # -- running one batch ---------------------------------------------------------------------------
    async def _run(self, batch_id: str, fence: Fence) -> None:
        try:
            row = await self._db(self.store.batch, batch_id)
            if row["status"] == S.VALIDATING:
                if not await self._db(self._validate, row, fence):
                    return
                row = await self._db(self.store.batch, batch_id)
            if row["status"] == S.IN_PROGRESS:
                await self._serve_lines(row, fence)
                row = await self._db(self.store.batch, batch_id)
            if row["status"] in (S.FINALIZING, S.CANCELLING) and not self.stopping:
                await self._db(self._finish, row, fence)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a bug must not leave the batch silent: it fails, saying so
            logger.exception("batch %s failed", batch_id)
            await self._db(self.store.move, batch_id, S.FAILED, fence=fence, errors=json.dumps(
                [{"code": "internal_error", "message": "the batch runner failed; see the server's log",
                  "param": None, "line": None}]))

    def _validate(self, row: dict, fence: Fence) -> bool:
        """(On the store's thread.) The input file, read and checked line by line."""
        batch_id, key = row["id"], self.keys.get(row["key"])
        path = self.store.file_path(row["input_file_id"])
        try:
            text = path.read_bytes().decode("utf-8")
        except FileNotFoundError:
            return self._fail(batch_id, fence, "invalid_file", f"input file {row['input_file_id']} is gone")
        except UnicodeDecodeError:
            return self._fail(batch_id, fence, "invalid_file", "the input file is not UTF-8 text")
        raw = text.splitlines()
        while raw and not raw[-1].strip():
            raw.pop()
        if not raw:
            return self._fail(batch_id, fence, "empty_file", "the input file has no lines")
        if len(raw) > self.config.max_lines:
            return self._fail(batch_id, fence, "too_many_lines",
                              f"the input file has {len(raw)} lines; at most {self.config.max_lines}")
        seen: set[str] = set()
        lines, models = [], set()
        for idx, text_line in enumerate(raw):
            line = self._check_line(idx, text_line, row["endpoint"], key, seen)
            lines.append(line)
            if line.request is not None:
                models.add(line.request["body"]["model"])
        self.store.add_lines(batch_id, lines, next(iter(models)) if len(models) == 1 else None)
        # (or it was cancelled meanwhile, or another process holds it now)
        return self.store.move(batch_id, S.IN_PROGRESS, fence=fence)

    def _check_line(self, idx: int, text: str, endpoint: str, key, seen: set[str]) -> Line:
        custom_id = None

        def bad(message: str, code: str = "invalid_request") -> Line:
            return Line(idx, custom_id, None, _error_line(custom_id, code, f"line {idx + 1}: {message}"))

        try:
            obj = json.loads(text)
        except ValueError as e:
            return bad(f"not JSON: {e}", "invalid_json_line")
        if not isinstance(obj, dict):
            return bad("a line must be a JSON object", "invalid_json_line")
        custom_id = obj.get("custom_id") if isinstance(obj.get("custom_id"), str) else None
        if custom_id is None:
            return bad("custom_id: a string is required", "missing_required_parameter")
        if custom_id in seen:
            return bad(f"custom_id {custom_id!r} appears more than once", "duplicate_custom_id")
        seen.add(custom_id)
        if obj.get("method") != "POST":
            return bad("method: POST is required", "invalid_method")
        if obj.get("url") != endpoint:
            return bad(f"url: {obj.get('url')!r} is not this batch's endpoint {endpoint}", "invalid_url")
        body = obj.get("body")
        if not isinstance(body, dict):
            return bad("body: a JSON object is required", "invalid_request")
        if body.get("stream"):
            return bad("body.stream: a batch line cannot stream", "invalid_request")
        model = body.get("model")
        try:
            if key is not None and not key.may_use(model):
                raise self.service.router.not_found(model, key.models)
            self.service.router.pool(model)
        except TandemError as e:
            return bad(f"body.model: {e.message}", "model_not_found")
        return Line(idx, custom_id, {"custom_id": custom_id, "body": body})

    def _fail(self, batch_id: str, fence: Fence, code: str, message: str) -> bool:
        self.store.move(batch_id, S.FAILED, fence=fence, errors=json.dumps([{"code": code, "message": message,
                                                                             "param": None, "line": None}]))
        return False

    async def _serve_lines(self, row: dict, fence: Fence) -> None:
        """Serve the pending lines until none is left, then finalize; stop (the lines not answered
        left pending) when the batch is cancelled or expires, this process drains, or it no longer
        holds the batch. A line handed back (its replica was removed, it found no capacity) stays
        pending and is served again in the next pass: a batch is never finalized with one left."""
        batch_id, route = row["id"], ENDPOINTS[row["endpoint"]]
        key = self.keys.get(row["key"])
        if row["key"] is not None and key is None:  # its key was removed: it never runs keyless
            await self._refuse_keyless(row, fence)
        slots = asyncio.Semaphore(self.config.lines_in_flight)
        tasks: set[asyncio.Task] = set()

        async def one(line: Line) -> None:
            try:
                await self._serve_line(batch_id, route, key, line, row["expires_at"], fence)
            finally:
                slots.release()

        try:
            while not await self._should_stop(batch_id, row["expires_at"], fence):
                pending = sorted(await self._db(self.store.pending, batch_id), key=_prefix_order)
                if not pending:
                    break
                for line in pending:
                    await slots.acquire()
                    if await self._should_stop(batch_id, row["expires_at"], fence):
                        slots.release()
                        break
                    task = asyncio.create_task(one(line))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                while tasks:  # the pass's last lines: finish them, unless the batch is cancelled or expires
                    await asyncio.wait(tasks, timeout=self.config.poll_s)
                    if await self._should_stop(batch_id, row["expires_at"], fence, draining_ok=True):
                        break
                if not self.stopping and await self._db(self.store.pending, batch_id):
                    await asyncio.sleep(self.config.poll_s)  # lines handed back: the next pass after a pause
        finally:
            for t in list(tasks):  # cancelled, expired, lost (or this process stops): aborted, still pending
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if self.stopping or (await self._db(self.store.batch, batch_id))["status"] != S.IN_PROGRESS:
            return
        if time.time() >= row["expires_at"]:
            await self._db(self._expire, row, fence)
        else:
            await self._db(self.store.move, batch_id, S.FINALIZING, fence=fence,
                           answered=True)

    async def _should_stop(self, batch_id: str, expires_at: int, fence: Fence, draining_ok: bool = False) -> bool:
        """Whether to start no more lines (``draining_ok``: whether to abort the ones in flight,
        which a drain lets finish): cancelled, expired, the lease lost, or (not ``draining_ok``)
        this process drains."""
        if self.stopping and not draining_ok:
            return True
        status = await self._db(self.store.held_status, batch_id, fence)  # one read: held, and its status
        if status is None:
            logger.warning("batch %s: this process no longer holds its lease; stopping it", batch_id)
            return True
        return status != S.IN_PROGRESS or time.time() >= expires_at

    async def _serve_line(self, batch_id: str, route: str, key, line: Line, expires_at: int, fence: Fence) -> None:
        body = line.request["body"]
        request_id = f"{batch_id}-{line.idx}"
        metrics = self.service.metrics
        delay = 0.25
        while True:
            try:
                env = envelope(route, dict(body), request_id=request_id, config=self.service.config, key=key,
                               max_depth=self.service.config.limits.max_json_depth, priority=self.config.priority)
                answer = await serve(self.service, env, internal=True)
            except TandemError as e:
                if e.kind is ErrorKind.SHUTTING_DOWN and (self.stopping or self.service.draining):
                    return  # this process drains: the line stays pending for whoever runs the batch next
                if (e.kind in TRANSIENT or e.kind is ErrorKind.SHUTTING_DOWN) and time.time() + delay < expires_at:
                    await asyncio.sleep(delay)  # a replica removed, no capacity: retried (backoff)
                    delay = min(delay * 2, 5.0)
                    continue
                out = _answer_line(line.custom_id, request_id, e.status, e.envelope())
                await self._store(batch_id, line, out, "failed", fence)
                return
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - never a silent line: an error line naming the request
                logger.exception("batch %s: line %d (request %s) failed", batch_id, line.idx, request_id)
                err = TandemError(ErrorKind.INTERNAL, f"the line's request failed in the gateway (request id "
                                  f"{request_id}; the server's log has the details)")
                await self._store(batch_id, line, _answer_line(line.custom_id, request_id, 500, err.envelope()),
                                  "failed", fence)
                return
            model = metrics.model_label(self.service.router.aliases.get(body.get("model"), body.get("model")))
            metrics.observe_served(model, getattr(key, "name", None))
            out = _answer_line(line.custom_id, request_id, 200, answer.json)
            await self._store(batch_id, line, out, "completed", fence, usage=answer.json.get("usage"))
            return

    async def _store(self, batch_id: str, line: Line, out: dict, outcome: str, fence: Fence,
                     usage: dict | None = None) -> None:
        """A line's answer, stored if this runner still holds the batch and the line is pending;
        counted (``tandem_batch_lines_total``) only then: a line answered twice is counted once."""
        if await self._db(self.store.answer, batch_id, line.idx, out, ok=outcome == "completed", usage=usage,
                          fence=fence):
            self.service.metrics.observe_batch_line(outcome)

    async def _refuse_keyless(self, row: dict, fence: Fence) -> None:
        """The batch's API key is gone (removed from the config): its pending lines fail with 401."""
        err = TandemError(ErrorKind.UNAUTHORIZED, f"the API key that created batch {row['id']} no longer exists; "
                          "its remaining lines are not run")
        for line in await self._db(self.store.pending, row["id"]):
            out = _answer_line(line.custom_id, f"{row['id']}-{line.idx}", err.status, err.envelope())
            await self._store(row["id"], line, out, "failed", fence)

    def _expire(self, row: dict, fence: Fence) -> None:
        """(On the store's thread.) Its unfinished lines as ``batch_expired`` errors, then ``expired``."""
        for line in self.store.pending(row["id"]):
            self.store.answer(row["id"], line.idx, _error_line(
                line.custom_id, "batch_expired",
                "This request could not be executed before the completion window expired."), ok=False, fence=fence)
        self.store.move(row["id"], S.EXPIRED, fence=fence, answered=True, **self._write_files(row))

    def _finish(self, row: dict, fence: Fence) -> None:
        """(On the store's thread.) The files, then ``cancelled`` or ``completed``."""
        files = self._write_files(row)
        if row["status"] == S.CANCELLING:
            self.store.move(row["id"], S.CANCELLED, fence=fence, **files)
        else:
            self.store.move(row["id"], S.COMPLETED, fence=fence, answered=True, **files)

    def _write_files(self, row: dict) -> dict:
        """The output and error files from the stored answers (ids derived from the batch's: a
        finalize that a crash interrupted writes the same files again, never two)."""
        expires = row["created_at"] + row["output_expires_s"] if row["output_expires_s"] else None
        out = {}
        for state, field, suffix in (("done", "output_file_id", "output"), ("failed", "error_file_id", "errors")):
            answers = self.store.answers(row["id"], state)
            if not answers:
                continue
            data = "".join(json.dumps(a) + "\n" for a in answers).encode()
            file_id = f"file-{row['id'].removeprefix('batch-')}-{suffix}"
            self.store.add_file(data, "batch_output", f"{row['id']}_{suffix}.jsonl", row["tenant"], expires,
                                file_id=file_id)
            out[field] = file_id
        return out



def _prefix_order(line: Line) -> tuple:
    """Lines of one model, then of the same prompt (messages, prompt or input, serialized) next to
    each other: shared prefixes are sent one after another."""
    body = line.request["body"]
    prompt = body.get("messages", body.get("prompt", body.get("input", "")))
    return str(body.get("model")), json.dumps(prompt, sort_keys=True)[:4096], line.idx


def _answer_line(custom_id: str | None, request_id: str, status: int, body: dict) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None}


def _error_line(custom_id: str | None, code: str, message: str) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}
