"""The HTTP side of the Files and Batch API (``gateway/batches/api.py`` does the work): each handler
reads its parameters, names the caller (its API key: tenant and role) and answers in OpenAI's
shapes; errors leave in the OpenAI envelope like every other route's."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import FileResponse

from gateway.batches.api import Batches, file_object
from gateway.request.intake import parse_json
from tandem_core.errors import invalid

MAX_LIMIT = 10_000


def _key(request: Request):
    return getattr(request.state, "tandem_key", None)  # None: auth is off


def _limit(limit: int | None, default: int) -> int:
    if limit is None:
        return default
    if not 1 <= limit <= MAX_LIMIT:
        raise invalid(f"limit: between 1 and {MAX_LIMIT}", "limit")
    return limit


def register_batch_routes(app, route, batches: Batches, max_json_depth: int) -> None:
    """Every store call runs off the event loop (``asyncio.to_thread``): a slow disk or a database
    another process holds stalls no request and no lease renewal."""

    def off_loop(fn, *args):
        return asyncio.to_thread(fn, *args)

    @route("files_create")
    async def create_file(request: Request) -> dict:
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise invalid("a multipart/form-data body with `file` and `purpose` is required", "file")
        form = await request.form()
        try:
            upload, purpose = form.get("file"), form.get("purpose")
            if upload is None or isinstance(upload, str):
                raise invalid("file: a file part is required", "file")
            if purpose is None:
                raise invalid("purpose: required", "purpose")
            data = await upload.read()
            return await off_loop(batches.upload, data, upload.filename or "upload", purpose, _key(request))
        finally:
            await form.close()

    @route("files_list")
    async def list_files(request: Request, purpose: str | None = None, limit: int | None = None,
                         after: str | None = None, order: str = "desc") -> dict:
        if order not in ("asc", "desc"):
            raise invalid("order: asc or desc", "order")
        return await off_loop(batches.list_files, _key(request), purpose, _limit(limit, MAX_LIMIT), after, order)

    @route("file")
    async def get_file(request: Request, file_id: str) -> dict:
        return file_object(await off_loop(batches.file, file_id, _key(request)))

    @route("file_delete")
    async def delete_file(request: Request, file_id: str) -> dict:
        return await off_loop(batches.delete_file, file_id, _key(request))

    @route("file_content")
    async def file_content(request: Request, file_id: str) -> FileResponse:
        row = await off_loop(batches.file, file_id, _key(request))
        return FileResponse(batches.store.file_path(file_id), media_type="application/octet-stream",
                            filename=row["filename"])

    @route("batches_create")
    async def create_batch(request: Request) -> dict:
        body = parse_json(await request.body(), max_json_depth)
        out = await off_loop(batches.create, body, _key(request))
        batches.runner.wake.set()
        return out

    @route("batches_list")
    async def list_batches(request: Request, after: str | None = None, limit: int | None = None) -> dict:
        return await off_loop(batches.list_batches, _key(request), after, _limit(limit, 20))

    @route("batch")
    async def get_batch(request: Request, batch_id: str) -> dict:
        return await off_loop(batches.batch, batch_id, _key(request))

    @route("batch_cancel")
    async def cancel_batch(request: Request, batch_id: str) -> dict:
        out = await off_loop(batches.cancel, batch_id, _key(request))
        batches.runner.wake.set()
        return out
