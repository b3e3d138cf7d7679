"""A direct channel to a pool actor for small steps: Ray's compiled graphs instead of an actor call.

An ordinary actor call costs about 1.7 ms of Ray's own machinery on a 2-core host (submission,
the object reference, the reply through the owner), which is most of a small step's fixed cost
through the pool. A compiled graph (``ray.dag``, ``experimental_compile``) binds one actor method
once and then moves each call's bytes through a shared-memory channel: about 0.3 ms from asyncio.

:class:`DirectChannel` carries :func:`~psg_server.transport.pack_call`'s blobs (the small-step fast
path, whole calls pickled into one ``bytes``) to :meth:`GradientWorker.run_packed
<psg_server.worker.GradientWorker.run_packed>` and its packed reply back. What stays as it was:

* Errors: an exception raised by the computation comes back as the same ``RayTaskError`` an actor
  call raises, so the dispatcher treats both alike.
* Lost actors: a compiled call whose actor dies may never complete, so every channel holds a
  watch, a call of :meth:`GradientWorker.watch <psg_server.worker.GradientWorker.watch>` (its own
  concurrency group) that returns only when the actor dies, with Ray's ``ActorDiedError``; a call
  in flight then fails with that error at once, as an actor call would, and the shard is retried.
  A call whose channel breaks first (Ray's reader fails with a channel error, or any error that is
  not the computation's) is the same loss: it raises the watch's error, or ``RayActorError``.
* Only actors on the frontend's own node get a channel (shared memory); others, and any actor
  whose graph fails to compile (logged once), keep ordinary calls.

The price: Ray's channel readers poll, so every channel keeps one CPU core busy in its worker and
one in the frontend, idle or not. That is why channels are opt-in (``--direct-channels``): worth
it on a GPU node with cores to spare and a latency-bound trainer, not on a small CPU host. Compiling
a channel blocks the event loop for about 0.1 s, once per worker when it comes up.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, NoReturn

import ray
from ray import exceptions as ray_errors

from psg_server.transport import as_future

__all__ = ["DirectChannel", "local_node_id"]

logger = logging.getLogger(__name__)

#: How long a call whose channel broke waits for its actor's death watch to say why (seconds).
_WATCH_GRACE_S = 2.0


def local_node_id() -> str | None:
    """The hex id of the Ray node this process runs on (None without Ray)."""
    if not ray.is_initialized():
        return None
    try:
        return str(ray.get_runtime_context().get_node_id())
    except Exception:  # noqa: BLE001 (a driver without a node: no local actors then)
        return None


class DirectChannel:
    """A compiled graph around one actor's ``run_packed``; see the module docstring.

    Build it with :meth:`open` on the event loop's thread (compiling binds the graph to that loop).
    """

    def __init__(self, graph: Any, watch: asyncio.Future[Any], name: str) -> None:
        self._graph = graph
        self._watch = watch
        self._name = name
        self._lock = asyncio.Lock()
        self._closed = False
        self._teardown_thread: threading.Thread | None = None

    @classmethod
    def open(cls, handle: Any, name: str) -> DirectChannel:
        """Compiles ``handle.run_packed`` into a graph and starts the actor's death watch."""
        from ray.dag import InputNode

        with InputNode() as call:
            node = handle.run_packed.bind(call)
        graph = node.experimental_compile(enable_asyncio=True)
        watch = as_future(handle.watch.remote())
        watch.add_done_callback(_consume)  # the error is read where it matters; never "never retrieved"
        return cls(graph, watch, name)

    @property
    def usable(self) -> bool:
        """Not closed, and its actor not known dead."""
        return not self._closed and not self._watch.done()

    async def call(self, packed: bytes) -> bytes:
        """The actor's packed reply to ``packed``; raises what an actor call would (the
        computation's ``RayTaskError``, or the actor's death as ``ActorDiedError``)."""
        if not self.usable:
            self._raise_lost()
        async with self._lock:  # one call at a time through the graph (the actor runs one anyway)
            reply = asyncio.ensure_future(_result(await self._graph.execute_async(packed)))
            reply.add_done_callback(_consume)  # a reply that fails after the watch won: read, not "never retrieved"
            done, _ = await asyncio.wait([reply, self._watch], return_when=asyncio.FIRST_COMPLETED)
            if reply in done:
                error = reply.exception()
                if error is None or isinstance(error, ray_errors.RayTaskError):
                    return reply.result()  # type: ignore[no-any-return]  # the computation's own error raises
                # The channel itself broke: when the actor under a call dies, Ray's reader fails with
                # RayChannelError, or (ray 2.60) with a TypeError from caching that error as a result.
                # Either way the actor is lost: its watch says how, when it says so soon.
                await asyncio.wait([self._watch], timeout=_WATCH_GRACE_S)
                self.close()
                self._raise_lost(error)
            reply.cancel()
            self.close()
            self._raise_lost()

    def _raise_lost(self, cause: BaseException | None = None) -> NoReturn:
        error = self._watch.exception() if self._watch.done() and not self._watch.cancelled() else None
        if isinstance(error, BaseException):
            raise error from cause
        detail = f"broke ({type(cause).__name__}: {cause})" if cause is not None else "is closed"
        raise ray_errors.RayActorError(error_msg=f"direct channel to {self._name} {detail}") from cause

    def close(self) -> None:
        """Closes the channel at once and tears the graph down on a thread of its own (teardown
        waits for a call still running in the actor, which must not hold up the event loop: the
        supervisor closes the channel of an actor it evicts mid-shard); idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self._watch.done():
            self._watch.cancel()
        self._teardown_thread = threading.Thread(target=self._teardown, name=f"psg-channel-teardown-{self._name}",
                                                 daemon=True)
        self._teardown_thread.start()

    @property
    def torn_down(self) -> bool:
        """Closed, and its graph's teardown done."""
        return self._teardown_thread is not None and not self._teardown_thread.is_alive()

    async def wait_closed(self, timeout_s: float) -> bool:
        """Waits (off the event loop) until :meth:`close`'s teardown is done; True if it is.

        Await it before the event loop closes: a graph whose actor died is also torn down by Ray's
        own monitor thread, which cancels the graph's reader task on this loop and fails if the loop
        is gone by then; the teardown joins that thread."""
        thread = self._teardown_thread
        if thread is None:
            return not self._closed
        await asyncio.to_thread(thread.join, timeout_s)
        return not thread.is_alive()

    def _teardown(self) -> None:
        try:
            self._graph.teardown()
        except Exception as error:  # noqa: BLE001 (its actor is dead or the cluster is going)
            logger.debug("pool: teardown of the direct channel to %s: %s", self._name, error)


async def _result(future: Any) -> Any:
    return await future


def _consume(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
