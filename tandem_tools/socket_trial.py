"""A trial, for measurement only: the gateway <-> replica channel over a Unix socket instead of
Ray (issue 15, item 2). Ray still places, starts, health-checks and restarts the actor and
carries every other call; only ``submit`` and the channel's batches take the socket.

Applied by monkeypatch in every process (``TANDEM_SOCKET_TRIAL=1`` with
``tandem_tools.hoptrace``'s ``sitecustomize`` first on PYTHONPATH), so today's code runs
unchanged without it. What it patches, and what the real change in ``workers/`` would be:

- ``EngineActor.open_socket(channel_id)`` (new): opens the channel's ``Outbox`` as
  ``open_channel`` does, listens on a Unix socket, returns its path. On the connection:
  ``("submit", args)`` frames call ``submit``; the outbox's batches go back as frames.
- ``RayReplicaHandle``: ``_channel`` asks the actor for the socket (one Ray call), connects and
  feeds the ``Demux`` from it; ``call("submit", ...)`` writes a frame instead of a Ray call.

Frames: a 4-byte length, then a pickle (what Ray would pickle anyway). Not handled in the
trial: TCP for a replica on another node, restarts (``_reopen_channel``), back-pressure.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import struct
import tempfile

HEADER = struct.Struct("!I")


def frame(obj) -> bytes:
    data = pickle.dumps(obj, protocol=5)
    return HEADER.pack(len(data)) + data


async def read_frame(reader: asyncio.StreamReader):
    (n,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return pickle.loads(await reader.readexactly(n))


# -- the actor's side ---------------------------------------------------------------------------
async def open_socket(self, channel_id: str) -> str:
    from workers.transport.channel import Outbox

    outbox = Outbox()
    self._channels[channel_id] = outbox
    async with self._channel_opened:
        self._channel_opened.notify_all()
    path = os.path.join(tempfile.gettempdir(), f"tandem-{os.getpid()}-{channel_id[:16]}.sock")

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async def pump() -> None:
            async for batch in outbox.stream():
                writer.write(frame(batch))
                await writer.drain()

        pumping = asyncio.create_task(pump())
        try:
            while True:
                op, args = await read_frame(reader)
                if op == "submit":
                    await self.submit(*args)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            outbox.close()
            self._channels.pop(channel_id, None)
            pumping.cancel()
            writer.close()

    server = await asyncio.start_unix_server(serve, path)
    self._trial_servers = [*getattr(self, "_trial_servers", []), server]
    return path


def _patch_actor(m) -> None:
    m.EngineActor.open_socket = open_socket


# -- the gateway's side -------------------------------------------------------------------------
def _patch_handles(m) -> None:
    from tandem_core.errors import ErrorKind, TandemError
    from workers.transport.channel import Demux

    cls = m.RayReplicaHandle
    ray_call = cls.call

    def _channel(self) -> Demux:
        if self._demux is None or self._demux.broken is not None:
            self._demux = Demux()
            self._writer = asyncio.get_running_loop().create_future()
            self._reader = asyncio.create_task(self._read_socket(self._demux, self._writer))
        return self._demux

    async def _read_socket(self, demux: Demux, writer_ready: asyncio.Future) -> None:
        try:
            path = await ray_call(self, "open_socket", self.channel_id)
            reader, writer = await asyncio.open_unix_connection(path)
            writer_ready.set_result(writer)
            while True:
                demux.feed(await read_frame(reader))
        except asyncio.CancelledError:
            demux.fail_all(TandemError(ErrorKind.ENGINE_DEAD, "the gateway is shutting down"))
            raise
        except Exception as e:  # noqa: BLE001 - whatever broke it, every request on it must end
            if not writer_ready.done():
                writer_ready.set_exception(e)
            err = self._dead(e)
        demux.fail_all(err)
        if self.on_broken is not None and demux is self._demux:
            self.on_broken(err)

    async def call(self, method: str, *args):
        if method != "submit":
            return await ray_call(self, method, *args)
        writer = await self._writer
        writer.write(frame(("submit", args)))
        await writer.drain()
        return None

    cls._channel, cls._read_socket, cls.call = _channel, _read_socket, call


PATCHES = {"workers.actor": _patch_actor, "workers.transport.handles": _patch_handles}
