"""The handles that reach a replica's ``EngineActor`` (``tandem_core.protocol.ReplicaHandle``).

``RayReplicaHandle`` talks to an actor in the Ray cluster; ``LocalReplicaHandle`` runs one in
this process (unit tests, no Ray). Both send requests with ``submit`` and read every request's
items from one multiplexed channel (``channel.py``).

The channel's bytes take one of two transports (``GatewayConfig.channel``): ``socket`` (a TCP
connection to the actor, ``socket_channel.py``; Ray only says where it listens) or ``ray`` (a Ray
streaming call, ``open_channel``; submits and aborts are Ray calls). Every other call (start,
health, stats, describe, shutdown) is a Ray call either way.

A handle also knows how to bring its replica back (``restart``): the Ray one kills a stuck
actor and lets Ray restart it (``max_restarts``), then starts the engine in the new process;
the local one builds a fresh in-process actor.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from tandem_core.errors import ErrorKind, TandemError, request_timeout
from tandem_core.protocol import DONE, EngineInfo, EngineRequest, EngineStats, Item, ReplicaHealth
from workers.transport.channel import END, Demux, items_of
from workers.transport.links import Link, RayLink, SocketLink

logger = logging.getLogger(__name__)


CHANNELS = ("socket", "ray")


class ChannelReplicaHandle:
    """Reaches an ``EngineActor`` through one multiplexed channel (``workers/transport/channel.py``).

    ``call(method, *args)`` awaits one actor method; ``stream(method, *args)`` iterates a
    streaming one. Subclasses bind them to Ray or to an in-process actor. ``channel``: the
    channel's transport, ``socket`` or ``ray`` (for an in-process actor: its stream, called
    directly).
    """

    lease_s: float | None = None  # the channel's lease on the replica (attached gateway processes)

    def __init__(self, channel: str = "ray") -> None:
        if channel not in CHANNELS:
            raise ValueError(f"unknown channel {channel!r} (one of {', '.join(CHANNELS)})")
        self.channel_kind = channel
        self.channel_id = uuid.uuid4().hex
        self._demux: Demux | None = None
        self._link: Link | None = None  # the channel's transport (``links.py``), with the demux
        self._reader: asyncio.Task | None = None
        self.on_broken: Callable[[TandemError], None] | None = None

    async def call(self, method: str, *args):
        raise NotImplementedError

    def stream(self, method: str, *args) -> AsyncIterator:
        raise NotImplementedError

    def _dead(self, exc: BaseException) -> TandemError:
        if isinstance(exc, OSError | asyncio.IncompleteReadError):  # the channel's socket
            return TandemError(ErrorKind.ENGINE_DEAD, "the connection to the replica serving this request was lost")
        return TandemError(ErrorKind.ENGINE_DEAD, "the replica serving this request failed")

    def _channel(self) -> tuple[Demux, Link]:
        """The open channel; (re)opened when there is none or it broke (e.g. after a restart)."""
        if self._demux is None or self._demux.broken is not None:
            self._demux = Demux()
            self._link = (SocketLink(self.channel_id, self.lease_s, self) if self.channel_kind == "socket"
                          else RayLink(self.channel_id, self))
            self._reader = asyncio.create_task(self._read(self._demux, self._link), name=f"channel-{self.channel_id}")
        return self._demux, self._link

    async def _read(self, demux: Demux, link: Link) -> None:
        try:
            async for batch in link.batches():
                demux.feed(batch)
            err = TandemError(ErrorKind.ENGINE_DEAD, "the replica closed its channel")
        except asyncio.CancelledError:
            demux.fail_all(TandemError(ErrorKind.ENGINE_DEAD, "the gateway is shutting down"))
            raise
        except Exception as e:  # noqa: BLE001 - whatever broke it, every request on it must end
            logger.warning("channel %s broke: %s: %s", self.channel_id, type(e).__name__, e)
            err = self._dead(e)
        finally:
            link.close()  # cancelled, perhaps before it began: nobody waits for it forever
        demux.fail_all(err)
        if self.on_broken is not None and demux is self._demux:
            self.on_broken(err)

    async def start(self) -> EngineInfo:
        info = await self.call("start")
        self._channel()
        return info

    def _stop_reading(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self._link is not None:  # its reader may be cancelled before it ever ran
            self._link.close()

    def fail_in_flight(self, err: TandemError) -> None:
        """End every request on this replica now with ``err`` (it is stuck or gone)."""
        self._stop_reading()
        if self._demux is not None:
            self._demux.fail_all(err)
            self._demux = None

    def _reopen_channel(self) -> None:
        """A channel to the replica's new process (one opened to the old one breaks without telling)."""
        self._stop_reading()
        if self._demux is not None:
            self._demux.fail_all(TandemError(ErrorKind.ENGINE_DEAD, "the replica serving this request restarted"))
        self._demux = None
        self._channel()

    async def restart(self, kill: bool) -> EngineInfo:
        """Bring the replica back: a new process (killing the old one when ``kill``), started."""
        raise NotImplementedError

    async def describe(self) -> dict:
        return await self.call("describe")

    async def generate(self, request: EngineRequest, timeout_at: float | None = None) -> AsyncIterator[Item]:
        """The request's items. Past ``timeout_at`` (loop time) it ends with a 504 error (an error
        event if it had begun streaming) and is aborted in the engine."""
        request_id = request.request_id
        demux, link = self._channel()
        queue = demux.register(request_id)
        done = expired = False  # done: the engine is finished with it (no abort needed)
        timer = None
        if timeout_at is not None:
            def expire() -> None:
                nonlocal expired
                expired = True  # neither finished nor abandoned by the client: abort it there
                queue.put_nowait(request_timeout())
                queue.put_nowait(END)
            timer = asyncio.get_running_loop().call_at(timeout_at, expire)
        try:
            try:
                await link.submit(request)
            except TandemError:
                raise
            except Exception as e:  # noqa: BLE001
                raise self._dead(e) from e
            async for item in items_of(queue):
                done = done or (not expired and _is_last(item))  # closing after it needs no abort
                yield item
            done = not expired
        finally:
            if timer is not None:
                timer.cancel()
            demux.unregister(request_id)
            if not done:  # the client went away, the stream failed or timed out: abort it there
                link.abort_soon(request_id)

    async def abort(self, request_id: str) -> bool:
        return await self.call("abort", request_id)

    async def health(self) -> ReplicaHealth:
        return await self.call("health")

    async def stats(self) -> EngineStats:
        return await self.call("stats")

    async def reset_prefix_cache(self) -> bool:
        return await self.call("reset_prefix_cache")

    async def lora(self, op: str, body: dict) -> str:
        return await self.call("lora", op, body)

    async def shutdown(self) -> None:
        self._stop_reading()
        await self.call("shutdown")


class LocalReplicaHandle(ChannelReplicaHandle):
    """An ``EngineActor`` in this process (unit tests, no Ray); same channel code path.
    ``factory`` builds a fresh actor for ``restart``."""

    def __init__(self, actor, factory: Callable[[], Any] | None = None, channel: str = "ray"):
        super().__init__(channel)
        self.actor = actor
        self.factory = factory

    async def call(self, method: str, *args):
        result = getattr(self.actor, method)(*args)
        return await result if asyncio.iscoroutine(result) else result

    def stream(self, method: str, *args) -> AsyncIterator:
        return getattr(self.actor, method)(*args)

    async def restart(self, kill: bool) -> EngineInfo:
        if self.factory is None:
            raise RuntimeError("this replica cannot be restarted (no factory)")
        old, self.actor = self.actor, self.factory()
        old.cut_off()  # what a killed process would lose: its socket, connections and channels
        info = await self.call("start")
        self._reopen_channel()
        return info


class RayReplicaHandle(ChannelReplicaHandle):
    """An ``EngineActor`` in the Ray cluster."""

    def __init__(self, actor, channel: str = "socket"):
        super().__init__(channel)  # GatewayConfig.channel
        self.actor = actor

    async def call(self, method: str, *args):
        return await getattr(self.actor, method).remote(*args)

    async def health(self) -> ReplicaHealth:
        from ray.exceptions import RayActorError

        try:
            return await self.call("health")
        except RayActorError as e:
            raise TandemError(ErrorKind.ENGINE_DEAD, f"the replica's actor died: {type(e).__name__}") from e

    async def restart(self, kill: bool) -> EngineInfo:
        """Ray restarts a dead actor (``max_restarts``); a stuck one is killed first. Calls made
        while it restarts fail or wait; retried until a *new* process has started its engine (a
        call may still reach the old one while the kill is under way: its incarnation tells)."""
        import ray
        from ray.exceptions import RayActorError

        old = None
        if kill:
            try:
                old = (await asyncio.wait_for(self.call("describe"), 5))["incarnation"]
            except Exception:  # noqa: BLE001 - dead or unresponsive: any answer later is a new one
                old = None
            try:
                ray.kill(self.actor, no_restart=False)
            except Exception as e:  # noqa: BLE001 - already gone: Ray restarts it anyway
                logger.info("kill before restart: %s: %s", type(e).__name__, e)
        delay = 0.2
        while True:
            try:
                info = await self.call("start")
                if old is None or (await self.call("describe"))["incarnation"] != old:
                    break
            except RayActorError as e:
                logger.debug("replica not back yet: %s", type(e).__name__)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
        self._reopen_channel()
        return info

    async def stream(self, method: str, *args) -> AsyncIterator:
        gen = getattr(self.actor, method).options(num_returns="streaming").remote(*args)
        try:
            async for ref in gen:
                yield await ref
        finally:
            import ray

            ray.cancel(gen)

    def _dead(self, exc: BaseException) -> TandemError:
        from ray.exceptions import RayActorError

        if isinstance(exc, RayActorError):
            return TandemError(ErrorKind.ENGINE_DEAD, "the replica serving this request died")
        if isinstance(exc, OSError | asyncio.IncompleteReadError):
            return super()._dead(exc)
        logger.error("replica call failed: %s: %s", type(exc).__name__, exc)
        return TandemError(ErrorKind.ENGINE_ERROR, "the replica failed on this request")


def _is_last(item: Item) -> bool:
    """An item after which the engine sends nothing more for the request (``tandem_core.protocol``):
    a whole response, an error, or the ``[DONE]`` event. The gateway stops reading there, so
    without this every finished request would also send an abort to the replica."""
    return isinstance(item, dict | TandemError) or (isinstance(item, str) and item.endswith(DONE))


ATTACH_CALL_S = 10.0
CHANNEL_LEASE_MIN_S = 30.0  # an attached gateway's channel outlives this many seconds without a health check


class AttachedReplicaHandle(RayReplicaHandle):
    """A replica that another gateway process owns (``RayDeployment`` role ``attached``): found
    by its actor's name, used like any other, never started, restarted or killed from here.
    ``start`` waits until the owner has started its engine; ``restart`` waits until the owner
    has brought it back (a new incarnation, started), then reopens this process's channel."""

    def __init__(self, name: str, lease_s: float = CHANNEL_LEASE_MIN_S, channel: str = "socket"):
        super().__init__(None, channel=channel)
        self.name = name
        self.lease_s = lease_s  # renewed by every health check (``EngineActor.health``)

    async def _resolve(self) -> None:
        import ray

        self.actor = await asyncio.to_thread(ray.get_actor, self.name, "tandem")

    async def call(self, method: str, *args):
        if self.actor is None:
            await self._resolve()
        return await super().call(method, *args)

    async def _wait_started(self) -> EngineInfo:
        """Poll until the actor's engine is started (the owner starts it)."""
        from ray.exceptions import RayActorError

        delay = 0.1
        while True:
            try:
                await self._resolve()  # the owner may have created it anew (same name)
                health = await asyncio.wait_for(self.call("health"), ATTACH_CALL_S)
                if health.started:
                    return await self.call("start")  # started: the owner's answer, not a second engine
            except (ValueError, RayActorError, TimeoutError) as e:  # ValueError: no actor of that name yet
                logger.debug("replica %s not there yet: %s", self.name, type(e).__name__)
            await asyncio.sleep(delay)  # a poll interval while the owner brings it up
            delay = min(delay * 2, 2.0)

    async def start(self) -> EngineInfo:
        info = await self._wait_started()
        self._channel()
        return info

    async def restart(self, kill: bool) -> EngineInfo:
        """Wait until the replica serves again, then reopen this process's channel. Whatever
        incarnation answers is taken: a dead process answers nothing, and one the owner is
        killing (it was stuck) breaks the channel again when it goes, and this repeats."""
        info = await self._wait_started()
        self._reopen_channel()
        return info

    def stream(self, method: str, *args):
        if method == "open_channel":  # the channel's lease starts with it
            args = (*args, self.lease_s)
        return super().stream(method, *args)

    async def health(self) -> ReplicaHealth:
        """Also renews this process's channel lease on the replica."""
        from ray.exceptions import RayActorError

        try:
            return await self.call("health", self.channel_id, self.lease_s)
        except RayActorError as e:
            raise TandemError(ErrorKind.ENGINE_DEAD, f"the replica's actor died: {type(e).__name__}") from e

    async def shutdown(self) -> None:
        """Only this process's channel: the replica is the owner's."""
        self.fail_in_flight(TandemError(ErrorKind.SHUTTING_DOWN, "the gateway is shutting down"))
