"""OpenAI's Files and Batch API, served on the running models at the lowest priority.

``Batches`` answers the routes (``gateway/app.py`` registers them) and runs the batches this
gateway process holds the lease of (``gateway/batch_store.py`` keeps every state durable):

1. ``validating``: the input file is read line by line. A line that is not a JSON object, has no
   ``custom_id`` (or one seen before), a ``method`` other than POST, a ``url`` other than the
   batch's endpoint, a ``body`` without a model this key may call, or ``stream: true`` is
   answered at once into the error file (with its ``custom_id``); it does not fail the others. A
   file wrong as a whole (missing, not UTF-8, empty, more than ``batches.max_lines`` lines)
   fails the batch, its ``errors`` saying why.
2. ``in_progress``: the pending lines are served ``batches.lines_in_flight`` at a time through
   ``gateway.generate.serve`` (the request record and admission of online requests) at
   ``batches.priority``, below every online request, under the submitting key's tenant: a batch
   takes the capacity online traffic leaves and yields it back. Lines are sent in the order of
   their model and prompt, so lines sharing a prompt prefix go one after another and prefix
   routing and the engines' prefix caches reuse it. A line whose replica failed, or that found
   no capacity (429, 503), is retried (backoff up to 5 s) until the batch expires: not lost.
3. ``finalizing``: the output file (answers of status 200) and the error file (the rest) are
   written from the stored answers, in input order, once; then ``completed``.

Cancel: ``cancelling`` at once; the runner sees it within ``batches.poll_s``, aborts its lines in
flight (they count as neither completed nor failed) and ends ``cancelled`` with the finished
lines' files. Expiry: a batch still running at ``expires_at`` ends ``expired``, keeping its
finished lines; its unfinished ones go to the error file with code ``batch_expired`` (OpenAI's).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import socket
import time
import uuid

from gateway.auth import resolve_keys
from gateway.batch_store import ACTIVE, BatchStore, Line
from gateway.envelope import envelope
from gateway.generate import serve
from tandem_core.errors import ErrorKind, TandemError, invalid

logger = logging.getLogger(__name__)

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/responses": "responses",
             "/v1/embeddings": "embeddings"}
PURPOSES = ("batch", "fine-tune", "assistants", "vision", "user_data", "evals")  # OpenAI's upload purposes
# Failures of capacity or of a replica, not of the line: it runs again (until the batch expires).
TRANSIENT = frozenset({ErrorKind.OVERLOADED, ErrorKind.NO_REPLICA, ErrorKind.ENGINE_DEAD, ErrorKind.QUEUE_TIMEOUT})
_WINDOW = re.compile(r"^(\d+)([smh])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600}


def window_seconds(window: object) -> int:
    """``completion_window``: OpenAI's "24h", or any ``<n>s|m|h`` (a shorter window: tandem's)."""
    m = _WINDOW.match(window) if isinstance(window, str) else None
    if m is None or int(m.group(1)) < 1:
        raise invalid("completion_window: a duration such as '24h' (OpenAI's only value), '30m' or '90s'",
                      "completion_window")
    return int(m.group(1)) * _UNIT_S[m.group(2)]


def not_found(what: str, ident: str, param: str) -> TandemError:
    return TandemError(ErrorKind.NOT_FOUND, f"No such {what}: '{ident}'", param)


class Batches:
    def __init__(self, service):
        self.service = service
        self.config = service.config.batches
        self.store = BatchStore(self.config.data_dir)
        auth = service.config.auth
        self.keys = ({k.name: k for k in resolve_keys(auth, base_dir=service.config.config_dir)}
                     if auth.enabled else {})
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.running: dict[str, asyncio.Task] = {}
        self._loop_task: asyncio.Task | None = None
        self._wake = asyncio.Event()

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
        self.store.close()

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
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.poll_s)

    # -- files ---------------------------------------------------------------------------------------
    def upload(self, data: bytes, filename: str, purpose: object, key) -> dict:
        if purpose not in PURPOSES:
            raise invalid(f"purpose: one of {', '.join(PURPOSES)}", "purpose")
        return file_object(self.store.add_file(data, purpose, filename, _tenant(key)))

    def file(self, file_id: str, key) -> dict:
        row = self.store.file(file_id)
        if row is None or not _visible(row["tenant"], key):
            raise not_found("file", file_id, "file_id")
        return row

    def list_files(self, key, purpose: str | None, limit: int, after: str | None, order: str) -> dict:
        rows = [r for r in self.store.files(purpose) if _visible(r["tenant"], key)]
        if order == "desc":
            rows.reverse()
        return _page([file_object(r) for r in rows], after, limit)

    def delete_file(self, file_id: str, key) -> dict:
        self.file(file_id, key)
        self.store.delete_file(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    # -- batches -------------------------------------------------------------------------------------
    def create(self, body: dict, key) -> dict:
        endpoint = body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise invalid(f"endpoint: one of {', '.join(ENDPOINTS)}", "endpoint")
        window_s = window_seconds(body.get("completion_window"))
        input_file_id = body.get("input_file_id")
        if not isinstance(input_file_id, str):
            raise invalid("input_file_id: the id of a file uploaded with purpose 'batch'", "input_file_id")
        row = self.file(input_file_id, key)
        if row["purpose"] != "batch":
            raise invalid(f"input_file_id: file {input_file_id} has purpose {row['purpose']!r}, not 'batch'",
                          "input_file_id")
        metadata = body.get("metadata")
        if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16 or not all(
                isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                for k, v in metadata.items())):
            raise invalid("metadata: up to 16 string keys (64 characters) and values (512)", "metadata")
        expires_after = body.get("output_expires_after")
        output_expires_s = None
        if expires_after is not None:
            seconds = expires_after.get("seconds") if isinstance(expires_after, dict) else None
            if (not isinstance(expires_after, dict) or expires_after.get("anchor") != "created_at"
                    or not isinstance(seconds, int) or not 3600 <= seconds <= 2592000):
                raise invalid("output_expires_after: {anchor: 'created_at', seconds: 3600 to 2592000}",
                              "output_expires_after")
            output_expires_s = seconds
        unknown = sorted(set(body) - {"endpoint", "completion_window", "input_file_id", "metadata",
                                      "output_expires_after"})
        if unknown:
            raise invalid(f"{unknown[0]}: not a field of a batch", unknown[0])
        row = self.store.add_batch(endpoint=endpoint, input_file_id=input_file_id, completion_window=
                                   body["completion_window"], window_s=window_s, metadata=metadata,
                                   output_expires_s=output_expires_s, tenant=_tenant(key),
                                   key=getattr(key, "name", None))
        self._wake.set()
        return self.batch_object(row)

    def batch(self, batch_id: str, key) -> dict:
        row = self.store.batch(batch_id)
        if row is None or not _visible(row["tenant"], key):
            raise not_found("batch", batch_id, "batch_id")
        return self.batch_object(row)

    def list_batches(self, key, after: str | None, limit: int) -> dict:
        rows = [r for r in self.store.batches() if _visible(r["tenant"], key)]
        return _page([self.batch_object(r) for r in rows], after, limit)

    def cancel(self, batch_id: str, key) -> dict:
        self.batch(batch_id, key)
        if not self.store.move(batch_id, "cancelling", only_from=("validating", "in_progress")):
            status = self.store.batch(batch_id)["status"]
            if status not in ("cancelling", "cancelled"):
                raise TandemError(ErrorKind.INVALID_REQUEST,
                                  f"Cannot cancel a batch with status '{status}'.", "batch_id")
        self._wake.set()
        return self.batch(batch_id, key)

    def batch_object(self, row: dict) -> dict:
        counts = self.store.counts(row["id"])
        errors = json.loads(row["errors"]) if row["errors"] else None
        return {
            "id": row["id"], "object": "batch", "endpoint": row["endpoint"], "model": row["model"],
            "errors": {"object": "list", "data": errors} if errors else None,
            "input_file_id": row["input_file_id"], "completion_window": row["completion_window"],
            "status": row["status"], "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"],
            "created_at": row["created_at"], "in_progress_at": row["in_progress_at"],
            "expires_at": row["expires_at"], "finalizing_at": row["finalizing_at"],
            "completed_at": row["completed_at"], "failed_at": row["failed_at"], "expired_at": row["expired_at"],
            "cancelling_at": row["cancelling_at"], "cancelled_at": row["cancelled_at"],
            "request_counts": counts["request_counts"],
            "metadata": json.loads(row["metadata"]) if row["metadata"] else None,
            "usage": counts["usage"],
        }

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
                answer = await serve(self.service, env)
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


def file_object(row: dict) -> dict:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed",
            "expires_at": row["expires_at"], "status_details": None}


def _tenant(key) -> str | None:
    return getattr(key, "tenant_name", None)


def _visible(tenant: str | None, key) -> bool:
    """A key sees its tenant's files and batches; an admin key (or no auth) sees every one."""
    return key is None or getattr(key, "role", "user") == "admin" or tenant == key.tenant_name


def _page(items: list[dict], after: str | None, limit: int) -> dict:
    if after is not None:
        ids = [i["id"] for i in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}
