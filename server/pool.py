"""The Ray worker pool (DESIGN.md §3 "Ray pool"): :class:`WorkerPool`, a :class:`ShardExecutor`.

Ray stays behind this class: the frontend sees an executor that runs shards, lists workers and
their throughputs, and raises psg errors. One :class:`~psg_server.worker.GradientWorker` actor runs
per GPU (``num_gpus=1``) when the cluster has GPUs, otherwise per ``cpus_per_worker`` CPU cores
(with as many torch threads); a fixed number of GPU workers above the cluster's GPUs shares them
(``num_gpus`` a fraction: :mod:`psg_server.placement`), and a worker Ray cannot place within
``place_timeout_s`` is an error, not a wait without end. Without an address the pool starts an embedded local Ray
(``address="local"``, never someone else's instance); ``ray_address`` joins a cluster.

The pool is a facade over three parts:

* :mod:`psg_server.supervisor` keeps the actors alive and placed: it follows the cluster's live
  nodes (actors for workers that join, none left on nodes that drain or leave), replaces dead
  actors, probes idle ones and says whether the pool is :attr:`~WorkerPool.ready` (which drives
  the health status). Its actors run with :data:`WORKER_ENV`.
* :mod:`psg_server.dispatch` runs a step's shards: each on the actor the plan pinned it to (the
  frontend plans with :mod:`psg_server.scheduler`, by the :meth:`~WorkerPool.throughputs` measured
  here), a lost shard again on another live actor; cancelling :meth:`~WorkerPool.run` (the step's
  deadline) cancels the shards in flight. With no live worker when a step starts,
  :meth:`~WorkerPool.run` raises :class:`NoWorkersError` (UNAVAILABLE) at once; a step that loses its
  last worker midway waits up to ``worker_wait_s`` for a replacement.
* :mod:`psg_server.transport` moves the tensors: shards, parameters and results as raw out-of-band
  bytes, small ones inside the actor calls and large ones through the object store. A parameter
  version is one flat buffer (put at most once per (session, version)), the frozen parameters
  another, put once per (session, frozen version); workers keep each session's model resident on
  their device, fetch a version only when it lacks it, and drop the model on
  :meth:`~WorkerPool.release`. A result is one flat gradient buffer.

Object references are awaited through asyncio futures; blocking Ray calls (``ray.init``,
``ray.put``, ``ray.shutdown``) run on a thread, never on the event loop.

>>> import asyncio
>>> async def demo() -> int:
...     pool = WorkerPool(num_workers=1, ray_init_kwargs={"num_cpus": 1, "include_dashboard": False})
...     await pool.start()
...     try:
...         return len(pool.workers())
...     finally:
...         await pool.close()
>>> asyncio.run(demo())  # doctest: +SKIP
1
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import ray

from psg_server.cluster import connect
from psg_server.dispatch import ShardDispatcher
from psg_server.errors import NoWorkersError
from psg_server.executor import ParameterSet, SessionSpec, Shard, ShardResult, WorkerDescription
from psg_server.supervisor import WORKER_ENV, ActorSupervisor
from psg_server.transport import ParameterRefs, as_future

__all__ = ["WORKER_ENV", "WorkerPool"]

logger = logging.getLogger(__name__)


class WorkerPool:
    """Runs shards on Ray actors, one per GPU or per ``cpus_per_worker`` cores.

    Args:
        plugins: model plugin modules the workers load (the frontend registry's ``plugins``).
        num_workers: actors to keep; None = follow the cluster: one per GPU of its live nodes, or
            one per ``cpus_per_worker`` CPUs when it has no GPU, adding actors for nodes that join
            and dropping those of nodes that leave (:mod:`psg_server.supervisor`).
        cpus_per_worker: CPU cores Ray reserves for each actor, and its torch threads.
        ray_address: a cluster to join (``host:port`` or ``ray://...``); None starts an embedded
            local Ray, shut down again by :meth:`close`. When this process is already connected
            to Ray (``ray.init`` was called), the pool uses that connection and leaves it open.
        use_gpus: None = when the cluster has GPUs; False forces CPU workers (no GPU asked of
            Ray); True requires GPUs. GPU workers get a GPU each, or share them when
            ``num_workers`` exceeds the cluster's GPUs (:func:`psg_server.placement.gpus_per_worker`).
        worker_wait_s: how long a step that lost its last live worker midway waits for a
            replacement (a step that finds none live when it starts fails at once).
        start_timeout_s: how long :meth:`start` waits for the actors to come up; the pool keeps
            waiting for late ones in the background.
        probe_interval_s: seconds between liveness probes.
        probe_timeout_s: a worker that does not answer a probe this long is replaced.
        place_timeout_s: a worker that has not come up this long after it was created (Ray could
            not place it) is killed with an error saying what it asked for and what the cluster
            has; :meth:`start` raises that error when no worker came up.
        max_shard_attempts: tries of one shard on lost workers before the step fails.
        ray_init_kwargs: extra ``ray.init`` arguments (num_cpus, object_store_memory...).
        direct_channels: small steps reach the workers on this node through a compiled Ray graph
            instead of an actor call (:mod:`psg_server.channel`: about 1.4 ms less per step, for a
            CPU core kept busy on each side of every channel).
    """

    def __init__(self, *, plugins: Sequence[str] = (), num_workers: int | None = None,
                 cpus_per_worker: int = 1, ray_address: str | None = None, use_gpus: bool | None = None,
                 worker_wait_s: float = 30.0, start_timeout_s: float = 120.0, probe_interval_s: float = 1.0,
                 probe_timeout_s: float = 30.0, place_timeout_s: float = 90.0, max_shard_attempts: int = 3,
                 ray_init_kwargs: Mapping[str, Any] | None = None, direct_channels: bool = False) -> None:
        if num_workers is not None and num_workers < 1:
            raise ValueError(f"WorkerPool: num_workers must be >= 1 or None, got {num_workers}")
        if cpus_per_worker < 1:
            raise ValueError(f"WorkerPool: cpus_per_worker must be >= 1, got {cpus_per_worker}")
        if max_shard_attempts < 1:
            raise ValueError(f"WorkerPool: max_shard_attempts must be >= 1, got {max_shard_attempts}")
        self._num_workers = num_workers
        self._cpus_per_worker = cpus_per_worker
        self._ray_address = ray_address
        self._use_gpus = use_gpus
        self._ray_init_kwargs = dict(ray_init_kwargs or {})
        self._owns_ray = False
        self._supervisor = ActorSupervisor(plugins=tuple(plugins), cpus_per_worker=cpus_per_worker,
                                           start_timeout_s=start_timeout_s, probe_interval_s=probe_interval_s,
                                           probe_timeout_s=probe_timeout_s, place_timeout_s=place_timeout_s,
                                           direct_channels=direct_channels)
        self._parameters = ParameterRefs()
        self._dispatcher = ShardDispatcher(self._supervisor, self._parameters, max_attempts=max_shard_attempts,
                                           worker_wait_s=worker_wait_s)

    @property
    def ready(self) -> bool:
        """True once started and while at least one worker is live."""
        return self._supervisor.ready

    @property
    def pinned_inputs(self) -> bool:
        """False: the frontend hands its tensors to Ray, and GPU workers pin what they unpickle."""
        return False

    async def start(self) -> None:
        """Connects to (or starts) Ray and starts the actors; returns when they are all up, or
        after ``start_timeout_s`` with whichever are up (the rest keep starting).

        Raises:
            NoWorkersError: Ray cannot be joined or started, ``use_gpus`` is True on a cluster
                without a GPU, or no worker came up because Ray could place none (the pool is
                closed again, and an embedded Ray shut down).
        """
        if self._supervisor.running:
            return
        await asyncio.get_running_loop().run_in_executor(None, self._connect)
        try:
            await self._supervisor.start(count=self._num_workers, use_gpu=self._use_gpus)
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Stops the actors (and the embedded Ray, if the pool started it)."""
        await self._supervisor.close()
        self._parameters.clear()
        if self._owns_ray:
            self._owns_ray = False
            await asyncio.get_running_loop().run_in_executor(None, ray.shutdown)

    def workers(self) -> list[WorkerDescription]:
        """The live workers, by slot."""
        return [a.description for a in self._supervisor.live() if a.description is not None]

    def throughputs(self) -> dict[str, float | None]:
        """Each live worker's measured throughput (EWMA of samples/s; None before its first shard),
        keyed by worker id, by slot: what the scheduler weighs shards by."""
        return {a.description.id: a.rate for a in self._supervisor.live() if a.description is not None}

    async def release(self, session_id: str) -> None:
        """Forgets the session's parameters and asks every live worker to drop its model (waiting
        at most a couple of seconds: the request is queued behind the worker's running shards)."""
        self._parameters.drop(session_id)
        futures = [as_future(a.handle.release.remote(session_id)) for a in self._supervisor.live()]
        if futures:
            done, _ = await asyncio.wait(futures, timeout=2.0)
            for future in done:
                if future.exception() is not None:
                    logger.info("pool: release of %s failed on a worker: %s", session_id, future.exception())

    async def run(self, spec: SessionSpec, parameters: ParameterSet,
                  shards: Sequence[Shard]) -> list[ShardResult]:
        """One result per shard, in shard order (see :mod:`psg_server.dispatch`)."""
        if not self._supervisor.running:
            raise NoWorkersError("ComputeGradients: the worker pool is not running")
        if not shards:
            return []
        if not self._supervisor.live():
            # At once, not after worker_wait_s: a client whose deadline is shorter than that would
            # see DEADLINE_EXCEEDED instead, and could not tell a dead pool from a slow step. (A
            # step that loses its last worker midway still waits for the replacement.)
            raise NoWorkersError("ComputeGradients: no live worker (replacements are starting); try again "
                                 "later")
        return await self._dispatcher.run(spec, parameters, shards)

    def _connect(self) -> None:
        """Blocking: joins or starts Ray (:func:`psg_server.cluster.connect`: token authentication,
        failures explained)."""
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"include_dashboard": False, **self._ray_init_kwargs}
            connect(self._ray_address, kwargs)
            self._owns_ray = True
            logger.info("pool: %s Ray at %s", "joined" if self._ray_address else "started an embedded",
                        self._ray_address or ray.get_runtime_context().gcs_address)
        elif self._ray_address:
            logger.warning("pool: this process is already connected to Ray; ignoring ray_address %s",
                           self._ray_address)
