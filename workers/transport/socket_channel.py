"""The channel's bytes over TCP instead of a Ray stream (``GatewayConfig.channel: socket``).

Ray still places, starts, health-checks and restarts a replica, and tells a gateway process
where its channel listens: ``EngineActor.open_socket`` (a Ray call) answers (host, port, token).
Only the channel's traffic takes the socket: ``submit`` and ``abort`` in, batches of items out
(``channel.py``'s ``Outbox`` and ``Demux`` on either end, as over Ray). Why: a Ray actor call
and a streamed Ray item cost an order of magnitude more than a socket's round trip
(``tandem_tools.bench.transport``), and so did the gateway's CPU per streamed token (the
figures: docs/benchmarks.md).

Frames: a 4-byte big-endian length, then a pickle (protocol 5). **Authentication comes before
any unpickling**: a client's first frame is the channel's token itself, raw bytes; the server
compares it (``hmac.compare_digest``) with the tokens it handed out, one per channel and good
for one connection, and closes the connection on anything else without reading further. The
token travels through Ray, so only a process Ray let call the actor can connect.

A connection is its channel: when either end drops it, the actor closes the channel's outbox
(its requests are aborted in the engine) and the gateway fails every request on it.

Pure asyncio: no Ray here (the actor passes its node's address in), so both ends are unit-tested.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import pickle
import secrets
import socket
import struct
from collections.abc import AsyncIterator
from typing import Any, Protocol

from tandem_core.errors import ErrorKind, TandemError
from tandem_core.protocol import EngineRequest
from workers.transport.channel import END, Batch, Outbox

logger = logging.getLogger(__name__)

HEADER = struct.Struct("!I")
TOKEN_BYTES = 32
AUTH_TIMEOUT_S = 10.0  # a connection that has not sent its token by then is closed
CONNECT_TIMEOUT_S = 10.0  # a replica's node that does not answer by then: the channel failed


def encode(obj: Any) -> bytes:
    data = pickle.dumps(obj, protocol=5)
    return HEADER.pack(len(data)) + data


def encode_batch(batch: Batch) -> bytes:
    """A batch as one frame. An item pickle refuses (an engine's odd exception) becomes an error
    for its request instead of breaking the channel for every request on it."""
    try:
        return encode(batch)
    except Exception:  # noqa: BLE001 - find the item(s) at fault
        safe = []
        for request_id, item in batch:
            try:
                pickle.dumps(item, protocol=5)
            except Exception as e:  # noqa: BLE001
                logger.error("request %s: an item could not be sent: %s: %s", request_id, type(e).__name__, e)
                item = TandemError(ErrorKind.ENGINE_ERROR, "the replica produced an item it could not send")
            safe.append((request_id, item))
        return encode(safe)


async def read_frame(reader: asyncio.StreamReader) -> Any:
    (n,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return pickle.loads(await reader.readexactly(n))


def _no_delay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Refused(Exception):
    pass


class ChannelHost(Protocol):
    """What the server needs from the actor (``workers.actor.EngineActor``)."""

    async def attach(self, channel_id: str, lease_s: float | None) -> Outbox:
        """A new outbox for ``channel_id``, registered as that channel's."""

    def detach(self, channel_id: str, outbox: Outbox) -> None:
        """The channel's connection is gone: close ``outbox`` (aborting its requests), forget it."""

    def submit_on(self, outbox: Outbox, request: EngineRequest) -> None:
        """Start a request whose items go to ``outbox``."""

    async def abort(self, request_id: str) -> bool: ...


# -- the actor's end ------------------------------------------------------------------------------
class ChannelServer:
    """One listening socket per actor (started by the first ``offer``); every authenticated
    connection on it is one gateway process's channel."""

    def __init__(self, host: ChannelHost, address: str):
        self.host = host
        self.address = address
        self.port: int | None = None
        self._server: asyncio.Server | None = None
        self._starting = asyncio.Lock()
        self._offers: dict[str, tuple[bytes, float | None]] = {}  # channel id -> (token, lease)
        self._aborts: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()  # the open connections
        self.frames_sent = 0  # batches written, all connections (tests watch back-pressure with it)
        self.refused = 0  # connections closed before authenticating

    async def offer(self, channel_id: str, lease_s: float | None = None) -> tuple[str, int, bytes]:
        """Where to connect for ``channel_id`` and the token to send first: (host, port, token).
        A new offer for the same channel replaces the previous token."""
        async with self._starting:
            if self._server is None:
                self._server = await asyncio.start_server(self._serve, self.address, 0)
                self.port = self._server.sockets[0].getsockname()[1]
                logger.info("channel socket listening on %s:%d", self.address, self.port)
        token = secrets.token_bytes(TOKEN_BYTES)
        self._offers[channel_id] = (token, lease_s)
        return self.address, self.port, token

    def close(self, drop: bool = False) -> None:
        """Stop listening. Open channels end when their outboxes close (``EngineActor.shutdown``);
        ``drop``: cut every connection now, sending nothing more (as a killed process does)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        self._offers.clear()
        if drop:
            for writer in list(self._writers):
                writer.transport.abort()

    async def _authenticate(self, reader: asyncio.StreamReader) -> tuple[str, float | None]:
        (n,) = HEADER.unpack(await reader.readexactly(HEADER.size))
        if n != TOKEN_BYTES:
            raise _Refused(f"a first frame of {n} bytes")
        token = await reader.readexactly(n)
        for channel_id, (expected, lease_s) in list(self._offers.items()):
            if hmac.compare_digest(expected, token):
                del self._offers[channel_id]  # good for one connection
                return channel_id, lease_s
        raise _Refused("an unknown token")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Python 3.11's start_server logs a cancelled handler as an error in a callback: this
        # task's cancellation (the loop closing) ends it quietly instead.
        self._writers.add(writer)
        try:
            await self._serve_channel(reader, writer)
        except asyncio.CancelledError:
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _serve_channel(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _no_delay(writer)
        peer = writer.get_extra_info("peername")
        try:
            channel_id, lease_s = await asyncio.wait_for(self._authenticate(reader), AUTH_TIMEOUT_S)
        except (_Refused, TimeoutError, asyncio.IncompleteReadError, ConnectionError) as e:
            self.refused += 1
            logger.warning("channel socket: connection from %s refused: %s", peer, e or type(e).__name__)
            return
        outbox = await self.host.attach(channel_id, lease_s)
        pump = asyncio.create_task(self._pump(outbox, writer), name=f"pump-{channel_id}")
        intake = asyncio.create_task(self._intake(reader, outbox), name=f"intake-{channel_id}")
        try:
            await asyncio.wait({pump, intake}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump, intake):
                task.cancel()
            await asyncio.gather(pump, intake, return_exceptions=True)
            self.host.detach(channel_id, outbox)  # its requests are aborted: nobody reads them now
            logger.info("channel %s: connection from %s closed", channel_id, peer)

    async def _pump(self, outbox: Outbox, writer: asyncio.StreamWriter) -> None:
        """Batches out. Back-pressure: the next batch is taken only once the last one is in the
        kernel's buffer; meanwhile the outbox gathers (and joins) what the requests produce."""
        try:
            async for batch in outbox.stream():
                writer.write(encode_batch(batch))
                self.frames_sent += 1
                await writer.drain()
        except ConnectionError:
            pass  # the gateway went away

    async def _intake(self, reader: asyncio.StreamReader, outbox: Outbox) -> None:
        """Requests in, in order: ``("submit", EngineRequest)``, ``("abort", (request_id,))``."""
        while True:
            try:
                op, args = await read_frame(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return  # the gateway closed its end (or died)
            if op == "submit":
                request_id = args.request_id
                try:
                    self.host.submit_on(outbox, args)
                except Exception as e:  # noqa: BLE001 - the request must hear of it, never silence
                    if not isinstance(e, TandemError):
                        logger.exception("request %s: submit failed", request_id)
                        e = TandemError(ErrorKind.ENGINE_ERROR, f"the replica could not start this request: "
                                        f"{type(e).__name__}")
                    outbox.put(request_id, e)
                    outbox.put(request_id, END)
            elif op == "abort":
                task = asyncio.create_task(self.host.abort(*args))
                self._aborts.add(task)
                task.add_done_callback(self._aborts.discard)
            else:
                logger.error("channel socket: unknown operation %r: connection closed (this is a bug)", op)
                return


# -- the gateway's end ----------------------------------------------------------------------------
class ChannelClient:
    """A gateway process's connection to one replica's channel."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader = reader
        self._writer = writer

    @classmethod
    async def connect(cls, host: str, port: int, token: bytes) -> ChannelClient:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT_S)
        _no_delay(writer)
        writer.write(HEADER.pack(len(token)) + token)
        return cls(reader, writer)

    def _send(self, message: tuple) -> None:
        if self._writer.is_closing():
            raise ConnectionResetError("the channel's connection is closed")
        self._writer.write(encode(message))

    async def submit(self, request: EngineRequest) -> None:
        self._send(("submit", request))
        await self._writer.drain()

    def abort(self, request_id: str) -> None:
        self._send(("abort", (request_id,)))

    @property
    def closed(self) -> bool:
        return self._writer.is_closing()

    async def batches(self) -> AsyncIterator[Batch]:
        """Every batch until the replica closes its end (then it returns; a cut frame raises)."""
        while True:
            try:
                header = await self._reader.readexactly(HEADER.size)
            except asyncio.IncompleteReadError as e:
                if e.partial:
                    raise
                return
            (n,) = HEADER.unpack(header)
            yield pickle.loads(await self._reader.readexactly(n))

    def close(self) -> None:
        self._writer.close()
