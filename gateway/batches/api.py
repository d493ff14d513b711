"""OpenAI's Files and Batch API, served on the running models at the lowest priority.

``Batches`` answers the routes (``gateway/http/app.py`` registers them); its ``BatchRunner``
(``gateway/batches/runner.py``) runs the batches this gateway process holds the lease of
(``gateway/batches/store.py`` keeps every state durable):

1. ``validating``: the input file is read line by line. A line that is not a JSON object, has no
   ``custom_id`` (or one seen before), a ``method`` other than POST, a ``url`` other than the
   batch's endpoint, a ``body`` without a model this key may call, or ``stream: true`` is
   answered at once into the error file (with its ``custom_id``); it does not fail the others. A
   file wrong as a whole (missing, not UTF-8, empty, more than ``batches.max_lines`` lines)
   fails the batch, its ``errors`` saying why.
2. ``in_progress``: the pending lines are served ``batches.lines_in_flight`` at a time through
   ``gateway.serving.serve`` (the request record and admission of online requests) at
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

import json
import re

from gateway.admission.keys import resolve_keys
from gateway.batches.runner import ENDPOINTS, BatchRunner
from gateway.batches.states import BatchStatus as S
from gateway.batches.store import BatchStore
from tandem_core.errors import ErrorKind, TandemError, invalid

PURPOSES = ("batch", "fine-tune", "assistants", "vision", "user_data", "evals")  # OpenAI's upload purposes
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
    """The routes' work: plain calls of the store (thread-safe), which ``batch_routes`` runs off the
    event loop; after a create or a cancel it wakes the runner (``runner.wake``, on the loop)."""

    def __init__(self, service):
        self.service = service
        self.config = service.config.batches
        self.store = BatchStore(self.config.directory)
        auth = service.config.auth
        keys = ({k.name: k for k in resolve_keys(auth, base_dir=service.config.config_dir)} if auth.enabled else {})
        self.runner = BatchRunner(service, self.store, keys)
        service.on_drain.append(self.runner.drain)  # SIGTERM: no new line; unfinished ones stay pending

    def start(self) -> None:
        self.runner.start()

    async def stop(self) -> None:
        """Stop running batches (their pending lines stay pending; another process may take them at
        once: the leases are released)."""
        await self.runner.stop()
        self.store.close()

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
        if not self.store.move(batch_id, S.CANCELLING):
            status = self.store.batch(batch_id)["status"]
            if status not in (S.CANCELLING, S.CANCELLED):
                raise TandemError(ErrorKind.INVALID_REQUEST,
                                  f"Cannot cancel a batch with status '{status}'.", "batch_id")
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
