"""SSE framing and client-disconnect handling for the OpenAI routes."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request

from gateway.serving.serve import ClientGone
from tandem_core.errors import ErrorKind, TandemError
from tandem_core.protocol import DONE

logger = logging.getLogger(__name__)
T = TypeVar("T")


async def until_disconnect(request: Request, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` unless the client disconnects first (then cancel it, raise ClientGone).

    Races the work against ``http.disconnect`` instead of polling. Call only after the body
    has been read: every message received here is then a disconnect.
    """
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        raise
    finally:
        watch.cancel()
    if work in done:
        return work.result()
    work.cancel()
    try:
        await work
    except (asyncio.CancelledError, Exception):  # noqa: BLE001 - it is being abandoned
        pass
    raise ClientGone()


async def _wait_disconnect(receive: Callable) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def sse_body(first: str, rest: AsyncIterator, on_close: Callable[[], None],
                   on_chunk: Callable[[str], None] | None = None) -> AsyncIterator[str]:
    """The body of a streaming response: engine SSE text, always ending in ``[DONE]``.

    A failure after the stream began (replica died, engine error) becomes an error event and
    ``[DONE]``; a stream that ends without ``[DONE]`` gets an error event too. Never a bare stop.
    """
    ended = first.endswith(DONE)
    try:
        yield first
        if ended:
            return
        async for chunk in rest:
            if isinstance(chunk, TandemError):  # replicas yield errors as values; framed here, once
                yield chunk.sse() + DONE
                return
            if not isinstance(chunk, str):
                logger.error("bug: non-SSE item %r in a stream", type(chunk).__name__)
                continue
            if on_chunk is not None:
                on_chunk(chunk)
            yield chunk
            if chunk.endswith(DONE):
                return
        yield TandemError(ErrorKind.ENGINE_ERROR, "the stream ended unexpectedly").sse() + DONE
    except TandemError as e:
        yield e.sse() + DONE
    except Exception:  # noqa: BLE001 - the client must get an ending
        logger.exception("stream failed")
        yield TandemError(ErrorKind.INTERNAL, "internal error while streaming").sse() + DONE
    finally:
        await _close(rest)
        on_close()


def error_event(route: str, err: TandemError) -> str:
    """A stream's last event when it fails after it began, in the route's own framing: the
    Anthropic error event on /v1/messages, the Responses API's ``error`` event otherwise."""
    if route.startswith("messages"):
        data = {"type": "error", "error": {"type": anthropic_error_type(err.status), "message": err.message}}
    else:
        info = err.envelope()["error"]  # code: OpenAI's string code when it has one, else the error type
        data = {"type": "error", "code": info["code"] if isinstance(info["code"], str) else info["type"],
                "message": err.message, "param": err.param, "sequence_number": -1}
    return f"event: error\ndata: {json.dumps(data)}\n\n"


def anthropic_error_type(status: int) -> str:
    """Anthropic's error ``type`` for an HTTP status (https://docs.anthropic.com/en/api/errors)."""
    return {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
            503: "overloaded_error", 529: "overloaded_error"}.get(status, "invalid_request_error" if status < 500
                                                                   else "api_error")


async def event_body(first: str, rest: AsyncIterator, on_close: Callable[[], None], route: str) -> AsyncIterator[str]:
    """The body of a stream with named events and no ``[DONE]`` (Responses, Anthropic Messages):
    the engine's SSE text until its iterator ends; a failure after it began is the route's error
    event (``error_event``)."""
    try:
        yield first
        async for chunk in rest:
            if isinstance(chunk, TandemError):
                yield error_event(route, chunk)
                return
            if isinstance(chunk, str):
                yield chunk
    except TandemError as e:
        yield error_event(route, e)
    except Exception:  # noqa: BLE001 - the client must get an ending
        logger.exception("stream failed")
        yield error_event(route, TandemError(ErrorKind.INTERNAL, "internal error while streaming"))
    finally:
        await _close(rest)
        on_close()


async def _close(it: AsyncIterator) -> None:
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:  # noqa: BLE001
            logger.exception("closing a replica stream failed")
