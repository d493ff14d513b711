"""Running the batches this gateway process holds the lease of (``gateway/batches.py`` answers
the routes; ``gateway/batch_store.py`` keeps every state durable). Steps and rules: see
``gateway/batches.py``'s docstring."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
import uuid

from gateway.batch_store import ACTIVE, BatchStore, Line
from gateway.envelope import envelope
from gateway.generate import serve
from tandem_core.errors import ErrorKind, TandemError

logger = logging.getLogger(__name__)

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/responses": "responses",
             "/v1/embeddings": "embeddings"}
# Failures of capacity or of a replica, not of the line: it runs again (until the batch expires).
TRANSIENT = frozenset({ErrorKind.OVERLOADED, ErrorKind.NO_REPLICA, ErrorKind.ENGINE_DEAD, ErrorKind.QUEUE_TIMEOUT})


class BatchRunner:
    def __init__(self, service, store: BatchStore, keys: dict):
        self.service = service
        self.config = service.config.batches
        self.store = store
        self.keys = keys  # API key name -> ``ResolvedKey``: a batch runs as the key that created it
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.running: dict[str, asyncio.Task] = {}
        self._loop_task: asyncio.Task | None = None
        self.wake = asyncio.Event()

    # -- the runner's life ---------------------------------------------------------------------------
    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._poll_loop())

    async def stop(self) -> None:
        """Stop running (the batches' pending lines stay pending) and let another process take over."""
        tasks = [t for t in (self._loop_task, *self.running.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.store.release(self.owner)

    async def _poll_loop(self) -> None:
        while True:
            try:
                for batch_id in self.store.claim(self.owner, self.config.lease_s):
                    if batch_id not in self.running:
                        task = asyncio.create_task(self._run(batch_id))
                        self.running[batch_id] = task
                        task.add_done_callback(lambda _t, b=batch_id: self.running.pop(b, None))
                for file_id in self.store.expired_files(time.time()):
                    self.store.delete_file(file_id)
                self.service.metrics.set_batches(self.store.states(), self.store.oldest_active())
            except Exception:  # noqa: BLE001 - the loop must go on (a locked database, a full disk)
                logger.exception("batch runner: poll failed")
            self.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), self.config.poll_s)

    # -- running one batch ---------------------------------------------------------------------------
    async def _run(self, batch_id: str) -> None:
        try:
            row = self.store.batch(batch_id)
            if row["status"] == "validating":
                if not self._validate(row):
                    return
                row = self.store.batch(batch_id)
            if row["status"] == "in_progress":
                await self._serve_lines(row)
                row = self.store.batch(batch_id)
            if row["status"] in ("finalizing", "cancelling"):
                self._finish(row)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a bug must not leave the batch silent: it fails, saying so
            logger.exception("batch %s failed", batch_id)
            self.store.move(batch_id, "failed", errors=json.dumps(
                [{"code": "internal_error", "message": "the batch runner failed; see the server's log",
                  "param": None, "line": None}]))

    def _validate(self, row: dict) -> bool:
        batch_id, key = row["id"], self.keys.get(row["key"])
        path = self.store.file_path(row["input_file_id"])
        try:
            text = path.read_bytes().decode("utf-8")
        except FileNotFoundError:
            return self._fail(batch_id, "invalid_file", f"input file {row['input_file_id']} is gone")
        except UnicodeDecodeError:
            return self._fail(batch_id, "invalid_file", "the input file is not UTF-8 text")
        raw = text.splitlines()
        while raw and not raw[-1].strip():
            raw.pop()
        if not raw:
            return self._fail(batch_id, "empty_file", "the input file has no lines")
        if len(raw) > self.config.max_lines:
            return self._fail(batch_id, "too_many_lines",
                              f"the input file has {len(raw)} lines; at most {self.config.max_lines}")
        seen: set[str] = set()
        lines, models = [], set()
        for idx, text_line in enumerate(raw):
            line = self._check_line(idx, text_line, row["endpoint"], key, seen)
            lines.append(line)
            if line.request is not None:
                models.add(line.request["body"]["model"])
        self.store.add_lines(batch_id, lines, next(iter(models)) if len(models) == 1 else None)
        self.store.move(batch_id, "in_progress", only_from=("validating",))  # (or it was cancelled meanwhile)
        return True

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

    def _fail(self, batch_id: str, code: str, message: str) -> bool:
        self.store.move(batch_id, "failed", errors=json.dumps([{"code": code, "message": message, "param": None,
                                                                "line": None}]))
        return False

    async def _serve_lines(self, row: dict) -> None:
        batch_id, route = row["id"], ENDPOINTS[row["endpoint"]]
        key = self.keys.get(row["key"])
        pending = sorted(self.store.pending(batch_id), key=_prefix_order)
        slots = asyncio.Semaphore(self.config.lines_in_flight)
        tasks: set[asyncio.Task] = set()

        async def one(line: Line) -> None:
            try:
                await self._serve_line(batch_id, route, key, line, row["expires_at"])
            finally:
                slots.release()

        try:
            for line in pending:
                await slots.acquire()
                if self._should_stop(batch_id, row["expires_at"]):
                    slots.release()
                    break
                task = asyncio.create_task(one(line))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            while tasks:  # the last lines: finish them, unless the batch is cancelled or expires
                await asyncio.wait(tasks, timeout=self.config.poll_s)
                if self._should_stop(batch_id, row["expires_at"]):
                    break
        finally:
            for t in list(tasks):  # cancelled or expired (or this process stops): aborted, still pending
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        status = self.store.batch(batch_id)["status"]
        if status == "in_progress":
            if time.time() >= row["expires_at"]:
                self._expire(row)
            else:
                self.store.move(batch_id, "finalizing", only_from=("in_progress",))

    def _should_stop(self, batch_id: str, expires_at: int) -> bool:
        return self.store.batch(batch_id)["status"] != "in_progress" or time.time() >= expires_at

    async def _serve_line(self, batch_id: str, route: str, key, line: Line, expires_at: int) -> None:
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
                if e.kind in TRANSIENT and time.time() + delay < expires_at:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 5.0)
                    continue
                if e.kind is ErrorKind.SHUTTING_DOWN:
                    return  # this process drains: the line stays pending for whoever runs the batch next
                out = _answer_line(line.custom_id, request_id, e.status, e.envelope())
                self.store.answer(batch_id, line.idx, out, ok=False)
                metrics.observe_batch_line("failed")
                return
            model = metrics.model_label(self.service.router.aliases.get(body.get("model"), body.get("model")))
            metrics.observe_served(model, getattr(key, "name", None))
            out = _answer_line(line.custom_id, request_id, 200, answer.json)
            self.store.answer(batch_id, line.idx, out, ok=True, usage=answer.json.get("usage"))
            metrics.observe_batch_line("completed")
            return

    def _expire(self, row: dict) -> None:
        for line in self.store.pending(row["id"]):
            self.store.answer(row["id"], line.idx, _error_line(
                line.custom_id, "batch_expired",
                "This request could not be executed before the completion window expired."), ok=False)
        self.store.move(row["id"], "expired", only_from=ACTIVE, **self._write_files(row))

    def _finish(self, row: dict) -> None:
        files = self._write_files(row)
        if row["status"] == "cancelling":
            self.store.move(row["id"], "cancelled", only_from=("cancelling",), **files)
        else:
            self.store.move(row["id"], "completed", only_from=("finalizing",), **files)

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
