"""The dispatch loop of a pool step: each shard to a live actor, lost shards retried elsewhere.

A shard goes to the actor its plan pinned it to while that actor is live, otherwise to the fastest
idle actor; each shard rides inside its call when small, or is put into the object store right
before its first call, so the first actor computes while the next shard is put. A shard whose
actor died (actor killed, process or node gone) is sent again, put into the object store afresh,
to another live actor after the supervisor evicted the dead one, waiting (at most
``worker_wait_s``) for a replacement when none is live; a shard whose actor the supervisor evicted
meanwhile (its node drains or left, a probe failed) is sent again at once, without waiting for Ray
to fail the call; a shard or parameter set the object store lost is put again. Errors raised by
the computation itself (bad model arguments...) are not retried. Cancelling
:meth:`ShardDispatcher.run` (the step's deadline) cancels the shards in flight.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Sequence
from typing import Any

import ray
from ray import exceptions as ray_errors

from psg_server.errors import NoWorkersError
from psg_server.executor import ParameterSet, SessionSpec, Shard, ShardResult
from psg_server.supervisor import ActorSupervisor, SupervisedActor
from psg_server.transport import ParameterRefs, as_future, cancel, pack_call, shard_argument, unpack

__all__ = ["ShardDispatcher"]

logger = logging.getLogger(__name__)

#: Ray errors after which the actor is gone and its shard goes to another one.
_WORKER_LOST: tuple[type[BaseException], ...] = (ray_errors.RayActorError, ray_errors.WorkerCrashedError,
                                                 ray_errors.NodeDiedError, ray_errors.LocalRayletDiedError)


class ShardDispatcher:
    """Runs a step's shards on the supervisor's live actors (see the module docstring).

    Args:
        supervisor: who is live, and who evicts the dead.
        parameters: the object-store references of the sessions' parameter sets.
        max_attempts: tries of one shard on lost actors before the step fails.
        worker_wait_s: how long a step waits for an actor when none is live.
    """

    def __init__(self, supervisor: ActorSupervisor, parameters: ParameterRefs, *, max_attempts: int,
                 worker_wait_s: float) -> None:
        self._supervisor = supervisor
        self._parameters = parameters
        self._max_attempts = max_attempts
        self._worker_wait_s = worker_wait_s

    async def run(self, spec: SessionSpec, parameters: ParameterSet, shards: Sequence[Shard]) -> list[ShardResult]:
        """One result per shard, in shard order."""
        loop = asyncio.get_running_loop()
        arguments = await self._parameters.arguments(spec.session_id, parameters)
        pinned = [None if shard.worker is None else self._supervisor.find(shard.worker) for shard in shards]
        # Made lazily, right before each shard's first call (a small shard rides inside the call, a
        # large one is put): the first actor starts computing while the next shard is put.
        shard_args: list[Any] = [None] * len(shards)
        results: list[ShardResult | None] = [None] * len(shards)
        attempts = [0] * len(shards)
        queue = collections.deque(range(len(shards)))
        # future -> (shard, actor, object ref (None through a direct channel), submit time)
        running: dict[asyncio.Future[Any], tuple[int, SupervisedActor, ray.ObjectRef | None, float]] = {}

        def retry(index: int, why: str) -> None:
            attempts[index] += 1
            if attempts[index] >= self._max_attempts:
                raise NoWorkersError(f"ComputeGradients: shard {index} was lost {attempts[index]} times (last: "
                                     f"{why}); workers keep failing")
            logger.warning("pool: shard %d lost (%s); retrying on another worker", index, why)
            pinned[index] = None
            queue.appendleft(index)

        try:
            while queue or running:
                for index in list(queue):
                    actor = self._assign(pinned, index, busy={a for _, a, _, _ in running.values()})
                    if actor is None:
                        continue
                    queue.remove(index)
                    shard_arg = shard_args[index]
                    if shard_arg is None:
                        shard_arg = shard_args[index] = await shard_argument(shards[index])
                    packed = pack_call(spec, arguments, shard_arg)
                    ref: ray.ObjectRef | None = None
                    if packed is not None and actor.channel is not None and actor.channel.usable:
                        future: asyncio.Future[Any] = asyncio.ensure_future(actor.channel.call(packed))
                    else:
                        ref = (actor.handle.run_shard.remote(spec, arguments, shard_arg, pack_result=True)
                               if packed is None else actor.handle.run_packed.remote(packed))
                        future = as_future(ref)
                    running[future] = (index, actor, ref, loop.time())
                if not running:
                    await self._supervisor.wait_for_live(self._worker_wait_s)
                    continue
                # Woken by a result, or by the supervisor: an actor came up (queued shards can go),
                # or one was evicted while its shard ran (its node drains or left, a probe failed).
                changed = asyncio.ensure_future(self._supervisor.wait_changed())
                done, _ = await asyncio.wait([*running, changed], return_when=asyncio.FIRST_COMPLETED)
                changed.cancel()
                done.discard(changed)
                for future, (index, actor, ref, _) in list(running.items()):
                    if not actor.live and future not in done:
                        # Sent elsewhere now, not when Ray fails the call: a stopped worker drains
                        # for up to 30 s, and its node is declared dead later still.
                        del running[future]
                        future.cancel()
                        if ref is not None:
                            cancel(ref)
                        shard_args[index] = None  # put again, as after any lost worker (below)
                        retry(index, "its worker was evicted")
                for future in done:
                    index, actor, _, submitted = running.pop(future)
                    error = future.exception()
                    if error is None:
                        value = future.result()
                        result: ShardResult = unpack(value) if isinstance(value, bytes) else value
                        results[index] = result
                        actor.observe(result.num_samples, loop.time() - submitted)
                        continue
                    if isinstance(error, ray_errors.RayTaskError):
                        cause = error.cause
                        if isinstance(cause, ray_errors.ObjectLostError):
                            error = cause  # the actor is fine; the objects are put again below
                        else:
                            raise cause if isinstance(cause, Exception) else error
                    if isinstance(error, ray_errors.ObjectLostError):
                        self._parameters.drop(spec.session_id)
                        arguments = await self._parameters.arguments(spec.session_id, parameters)
                        shard_args[index] = None  # put again when it is sent again
                    elif isinstance(error, _WORKER_LOST):
                        self._supervisor.evict(actor, f"shard {index} failed: {type(error).__name__}", cause=error)
                        # Put again too: the object directory may still list the lost node's copy
                        # of the shard, and the next actor would try to pull it from there first
                        # (tens of seconds) before falling back to the frontend's.
                        shard_args[index] = None
                    else:
                        raise error
                    retry(index, type(error).__name__)
        finally:
            for future, (_, _, ref, _) in running.items():
                future.cancel()
                if ref is not None:
                    cancel(ref)
        return [r for r in results if r is not None]

    def _assign(self, pinned: list[SupervisedActor | None], index: int, *,
                busy: set[SupervisedActor]) -> SupervisedActor | None:
        target = pinned[index]
        if target is not None:
            if target.live:
                return target
            pinned[index] = None  # its actor died: any actor will do
        idle = [a for a in self._supervisor.live() if a not in busy]
        if not idle:
            return None
        return max(idle, key=lambda a: a.rate if a.rate is not None else 0.0)
