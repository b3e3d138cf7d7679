"""The Ray worker pool (DESIGN.md §3 "Ray pool"): :class:`WorkerPool`, a :class:`ShardExecutor`.

Ray stays behind this module: the frontend sees an executor that runs shards, lists workers and
raises psg errors. One :class:`~psg_server.worker.GradientWorker` actor runs per GPU
(``num_gpus=1``) when the cluster has GPUs, otherwise per ``cpus_per_worker`` CPU cores (with as
many torch threads). Without an address the pool starts an embedded local Ray
(``address="local"``, never someone else's instance); ``ray_address`` joins a cluster.

A step:

* **Sharding.** The frontend's shards are re-cut into one contiguous run of whole samples (K rows
  each) per live worker, sized in proportion to each worker's measured throughput (an EWMA of
  samples/s); workers within 25% of each other get equal runs. When the frontend cut more
  shards than there are workers (``max_shard_samples``), the shards are queued instead and each
  worker takes the next when it is free, which balances by itself. Results come back in sample
  order, so their merge equals ``dp_gradient`` on the whole batch.
* **Parameters.** One ``ray.put`` per (session, version); workers fetch a version only when their
  cached model lacks it (see :mod:`psg_server.worker`) and drop the model on :meth:`release`.
* **Memory.** The actors' C allocator keeps the memory a shard frees for the next one
  (:data:`WORKER_ENV`) instead of handing it back and faulting it in again every step.
* **Transfer.** Pieces, parameters and results cross the object store as
  :class:`~psg_server.worker.TensorPayload` (raw tensor bytes out of band: one copy each side). A
  piece that lies inside one frontend shard is a view of it, not a copy. Each piece is put and its
  shard call sent at once, so the first worker starts while the next piece is still being put.
* **Faults.** A shard whose worker died (actor killed, process or node gone) is sent to another
  live worker, after waiting (at most ``worker_wait_s``) for a replacement when none is live; the
  dead actor is evicted and a replacement started. A monitor pings idle workers, so deaths between
  steps are noticed too. Errors raised by the computation itself (bad model arguments...) are not
  retried. Cancelling :meth:`run` (the step's deadline) cancels the in-flight shards
  (``ray.cancel``). With no live worker, :meth:`run` raises :class:`NoWorkersError` (UNAVAILABLE)
  and :attr:`ready` is False, which turns the health status to NOT_SERVING.
* **Awaiting.** Object references are awaited through ``asyncio.wrap_future``; blocking Ray calls
  (``ray.init``, ``ray.put``, ``ray.shutdown``) run on a thread, never on the event loop.

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
import collections
import functools
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
from ray import exceptions as ray_errors

from psg_core.config import DPGradient
from psg_server.errors import NoWorkersError
from psg_server.executor import ParameterSet, SessionSpec, Shard, WorkerDescription
from psg_server.worker import CONTROL_GROUP, GradientWorker, TensorPayload

__all__ = ["WORKER_ENV", "WorkerPool"]

logger = logging.getLogger(__name__)

#: Ray errors after which the worker is gone and its shard goes to another one.
_WORKER_LOST: tuple[type[BaseException], ...] = (ray_errors.RayActorError, ray_errors.WorkerCrashedError,
                                                 ray_errors.NodeDiedError, ray_errors.LocalRayletDiedError)
#: Workers whose throughputs are within this ratio get equal shares (measurements are noisy).
_BALANCE_TOLERANCE = 1.25
#: Weight of the newest measurement in the throughput EWMA.
_EWMA_ALPHA = 0.3
#: Environment of the actor processes, unless this process sets the variable itself. A DP step
#: allocates hundreds of MB (activations, per-sample gradients) and frees them at its end. glibc's
#: malloc serves large blocks with fresh ``mmap`` s (always above 32 MB, and in a thread's own
#: arena above 64 MB) and unmaps them on free, so each step faults all of it in again and the
#: kernel zeroes it: 40% of a 1024-sample CNN step on one core, more than linearly in the shard
#: size. One arena, no ``mmap`` for blocks and trimming only above 1 GiB free make a worker keep
#: and reuse its working set, as a caching allocator would (its memory stays at its peak). glibc
#: reads these at process start; other C libraries ignore them.
WORKER_ENV = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


@dataclass(eq=False)
class _Worker:
    """One actor. Replacing a dead worker makes a new ``_Worker``; identity tells them apart."""

    slot: int
    handle: Any
    description: WorkerDescription | None = None
    live: bool = False
    #: EWMA of samples per second (None until the first shard).
    rate: float | None = None

    def observe(self, samples: int, seconds: float) -> None:
        rate = samples / max(seconds, 1e-6)
        self.rate = rate if self.rate is None else (1 - _EWMA_ALPHA) * self.rate + _EWMA_ALPHA * rate


@dataclass(eq=False)
class _Slot:
    """A place for one worker; a dead worker's slot gets a replacement."""

    index: int
    worker: _Worker | None = None
    #: Consecutive actors that died before or soon after starting (drives the restart backoff).
    failures: int = 0
    restart_at: float = 0.0
    tasks: set[asyncio.Task[None]] = field(default_factory=set)


class WorkerPool:
    """Runs shards on Ray actors, one per GPU or per ``cpus_per_worker`` cores.

    Args:
        plugins: model plugin modules the workers load (the frontend registry's ``plugins``).
        num_workers: actors to keep; None = one per GPU, or one per ``cpus_per_worker`` CPUs
            when the cluster has no GPU.
        cpus_per_worker: CPU cores Ray reserves for each actor, and its torch threads.
        ray_address: a cluster to join (``host:port`` or ``ray://...``); None starts an embedded
            local Ray, shut down again by :meth:`close`. When this process is already connected
            to Ray (``ray.init`` was called), the pool uses that connection and leaves it open.
        max_shard_samples: largest run of samples one worker gets in one piece.
        use_gpus: None = when the cluster has GPUs; False forces CPU workers.
        worker_wait_s: how long a step waits for a worker when none is live.
        start_timeout_s: how long :meth:`start` waits for the actors to come up; the pool keeps
            waiting for late ones in the background.
        probe_interval_s: seconds between liveness probes.
        probe_timeout_s: a worker that does not answer a probe this long is replaced.
        max_shard_attempts: tries of one shard on lost workers before the step fails.
        ray_init_kwargs: extra ``ray.init`` arguments (num_cpus, object_store_memory...).
    """

    def __init__(self, *, plugins: Sequence[str] = (), num_workers: int | None = None,
                 cpus_per_worker: int = 1, ray_address: str | None = None, max_shard_samples: int = 1024,
                 use_gpus: bool | None = None, worker_wait_s: float = 30.0, start_timeout_s: float = 120.0,
                 probe_interval_s: float = 1.0, probe_timeout_s: float = 30.0, max_shard_attempts: int = 3,
                 ray_init_kwargs: Mapping[str, Any] | None = None) -> None:
        if num_workers is not None and num_workers < 1:
            raise ValueError(f"WorkerPool: num_workers must be >= 1 or None, got {num_workers}")
        if cpus_per_worker < 1:
            raise ValueError(f"WorkerPool: cpus_per_worker must be >= 1, got {cpus_per_worker}")
        if max_shard_samples < 1 or max_shard_attempts < 1:
            raise ValueError(f"WorkerPool: max_shard_samples and max_shard_attempts must be >= 1, got "
                             f"{max_shard_samples} and {max_shard_attempts}")
        self._plugins = tuple(plugins)
        self._num_workers = num_workers
        self._cpus_per_worker = cpus_per_worker
        self._ray_address = ray_address
        self._max_shard_samples = max_shard_samples
        self._use_gpus = use_gpus
        self._worker_wait_s = worker_wait_s
        self._start_timeout_s = start_timeout_s
        self._probe_interval_s = probe_interval_s
        self._probe_timeout_s = probe_timeout_s
        self._max_attempts = max_shard_attempts
        self._ray_init_kwargs = dict(ray_init_kwargs or {})
        self._slots: list[_Slot] = []
        self._actor_options: dict[str, Any] = {}
        self._actor_class: Any = None
        self._gpu = False
        self._owns_ray = False
        self._started = False
        self._monitor: asyncio.Task[None] | None = None
        # session id -> (version, reference of the ParameterSet in the object store)
        self._parameter_refs: dict[str, tuple[int, ray.ObjectRef]] = {}

    # ------------------------------------------------------------------------------- lifecycle
    @property
    def ready(self) -> bool:
        """True once started and while at least one worker is live."""
        return self._started and any(s.worker is not None and s.worker.live for s in self._slots)

    async def start(self) -> None:
        """Connects to (or starts) Ray and starts the actors; returns when they are all up, or
        after ``start_timeout_s`` with whichever are up (the rest keep starting)."""
        if self._started:
            return
        loop = asyncio.get_running_loop()
        resources = await loop.run_in_executor(None, self._connect)
        gpus = int(resources.get("GPU", 0))
        self._gpu = gpus > 0 if self._use_gpus is None else self._use_gpus
        if self._gpu and gpus == 0:
            raise NoWorkersError("WorkerPool.start: use_gpus=True, but the Ray cluster has no GPU")
        count = self._num_workers or (gpus if self._gpu else
                                      max(1, int(resources.get("CPU", 1) // self._cpus_per_worker)))
        self._actor_options = {
            "num_cpus": self._cpus_per_worker, "num_gpus": 1 if self._gpu else 0,
            # The pool replaces dead actors itself (possibly elsewhere) and retries their shards.
            "max_restarts": 0, "max_task_retries": 0,
            # Shards run one at a time; probes answer from their own thread meanwhile.
            "max_concurrency": 1,
            "scheduling_strategy": "SPREAD",
            "runtime_env": {"env_vars": {name: os.environ.get(name, value)
                                         for name, value in WORKER_ENV.items()}},
        }
        self._slots = [_Slot(index) for index in range(count)]
        self._started = True
        for slot in self._slots:
            self._spawn(slot)
        starting = [task for slot in self._slots for task in slot.tasks]
        await asyncio.wait(starting, timeout=self._start_timeout_s)
        self._monitor = asyncio.create_task(self._watch(), name="psg-pool-monitor")
        live = sum(1 for s in self._slots if s.worker is not None and s.worker.live)
        logger.info("pool: %d of %d %s worker(s) live", live, count, "GPU" if self._gpu else
                    f"{self._cpus_per_worker}-CPU")

    async def close(self) -> None:
        """Stops the monitor and the actors (and the embedded Ray, if the pool started it)."""
        if not self._started and not self._slots:
            return
        self._started = False
        if self._monitor is not None:
            self._monitor.cancel()
            await asyncio.gather(self._monitor, return_exceptions=True)
            self._monitor = None
        for slot in self._slots:
            for task in list(slot.tasks):
                task.cancel()
            if slot.worker is not None:
                self._kill(slot.worker)
                slot.worker = None
        self._slots = []
        self._actor_class = None
        self._parameter_refs.clear()
        if self._owns_ray:
            self._owns_ray = False
            await asyncio.get_running_loop().run_in_executor(None, ray.shutdown)

    def workers(self) -> list[WorkerDescription]:
        """The live workers, by slot."""
        return [s.worker.description for s in self._slots
                if s.worker is not None and s.worker.live and s.worker.description is not None]

    def throughputs(self) -> dict[str, float | None]:
        """Each live worker's measured throughput (EWMA of samples/s; None before its first shard),
        keyed by worker id: what the sharding balances by."""
        return {w.description.id: w.rate for w in self._live() if w.description is not None}

    async def release(self, session_id: str) -> None:
        """Forgets the session's parameters and asks every live worker to drop its model (waiting
        at most a couple of seconds: the request is queued behind the worker's running shards)."""
        self._parameter_refs.pop(session_id, None)
        futures = [_future(w.handle.release.remote(session_id)) for w in self._live()]
        if futures:
            done, _ = await asyncio.wait(futures, timeout=2.0)
            for future in done:
                if future.exception() is not None:
                    logger.info("pool: release of %s failed on a worker: %s", session_id, future.exception())

    # ------------------------------------------------------------------------------------ step
    async def run(self, spec: SessionSpec, parameters: ParameterSet,
                  shards: Sequence[Shard]) -> list[DPGradient]:
        """The step's shard results in sample order (see the module docstring)."""
        if not self._started:
            raise NoWorkersError("ComputeGradients: the worker pool is not running")
        if not shards:
            return []
        await self._wait_for_live()
        config = spec.dp_config
        K = config.augmentation_multiplicity
        batch_dim = 0 if config.batch_first else 1
        sizes = [shard.targets.shape[batch_dim] // K for shard in shards]
        piece_sizes, pinned = self._plan(sizes)
        if piece_sizes == sizes:  # the frontend's cut stands: the pieces are the shards (no copy)
            pieces = [Shard(index=index, inputs=shard.inputs, targets=shard.targets)
                      for index, shard in enumerate(shards)]
        else:  # pieces spanning shards are copied: off the event loop
            cut = functools.partial(_recut, shards, piece_sizes, K, batch_dim)
            pieces = await asyncio.get_running_loop().run_in_executor(None, cut)
        return await self._dispatch(spec, parameters, piece_sizes, pieces, pinned)

    def _plan(self, sizes: list[int]) -> tuple[list[int], list[_Worker | None]]:
        """Samples per piece, and the worker each piece is pinned to (None: first free worker)."""
        live = self._live()
        if len(sizes) > len(live):
            return sizes, [None] * len(sizes)  # a queue over more shards than workers balances itself
        total = sum(sizes)
        known = [w.rate for w in live if w.rate is not None]
        default = sum(known) / len(known) if known else 1.0
        fastest = sorted(live, key=lambda w: -(w.rate if w.rate is not None else default))
        chosen = fastest[:min(total, len(live))]
        weights = [w.rate if w.rate is not None else default for w in chosen]
        if max(weights) <= _BALANCE_TOLERANCE * min(weights):
            weights = [1.0] * len(chosen)
        piece_sizes = _proportional_sizes(total, weights)
        if max(piece_sizes) > max(self._max_shard_samples, max(sizes)):
            return sizes, [None] * len(sizes)  # keep the frontend's cut rather than overload a worker
        return piece_sizes, list(chosen)

    async def _dispatch(self, spec: SessionSpec, parameters: ParameterSet, sizes: list[int],
                        pieces: list[Shard], pinned: list[_Worker | None]) -> list[DPGradient]:
        loop = asyncio.get_running_loop()
        params_ref = await self._parameters_ref(spec.session_id, parameters)
        # Put lazily, right before each piece's first call: the first worker starts computing while
        # the next piece is put.
        piece_refs: list[ray.ObjectRef | None] = [None] * len(pieces)
        results: list[DPGradient | None] = [None] * len(pieces)
        attempts = [0] * len(pieces)
        queue = collections.deque(range(len(pieces)))
        # future -> (piece, worker, object ref, submit time)
        running: dict[asyncio.Future[Any], tuple[int, _Worker, ray.ObjectRef, float]] = {}
        try:
            while queue or running:
                for index in list(queue):
                    worker = self._assign(pinned, index, busy={w for _, w, _, _ in running.values()})
                    if worker is None:
                        continue
                    queue.remove(index)
                    piece_ref = piece_refs[index]
                    if piece_ref is None:
                        piece_ref = piece_refs[index] = await loop.run_in_executor(None, _put, pieces[index])
                    ref = worker.handle.run_shard.remote(spec, parameters.version, (params_ref,), piece_ref,
                                                         pack_result=True)
                    running[_future(ref)] = (index, worker, ref, loop.time())
                if not running:
                    await self._wait_for_live()
                    continue
                done, _ = await asyncio.wait(list(running), return_when=asyncio.FIRST_COMPLETED)
                for future in done:
                    index, worker, _, submitted = running.pop(future)
                    error = future.exception()
                    if error is None:
                        results[index] = future.result()
                        worker.observe(sizes[index], loop.time() - submitted)
                        continue
                    if isinstance(error, ray_errors.RayTaskError):
                        cause = error.cause
                        if isinstance(cause, ray_errors.ObjectLostError):
                            error = cause  # the worker is fine; the objects are re-put below
                        else:
                            raise cause if isinstance(cause, Exception) else error
                    if isinstance(error, ray_errors.ObjectLostError):
                        self._parameter_refs.pop(spec.session_id, None)
                        params_ref = await self._parameters_ref(spec.session_id, parameters)
                        piece_refs[index] = None  # put again when it is sent again
                    elif isinstance(error, _WORKER_LOST):
                        self._evict(worker, f"shard {index} failed: {type(error).__name__}")
                    else:
                        raise error
                    attempts[index] += 1
                    if attempts[index] >= self._max_attempts:
                        raise NoWorkersError(f"ComputeGradients: shard {index} was lost {attempts[index]} "
                                             f"times (last: {type(error).__name__}); workers keep failing")
                    logger.warning("pool: shard %d lost (%s); retrying on another worker", index,
                                   type(error).__name__)
                    pinned[index] = None
                    queue.appendleft(index)
        finally:
            for future, (_, _, ref, _) in running.items():
                future.cancel()
                _cancel(ref)
        return [r for r in results if r is not None]

    def _assign(self, pinned: list[_Worker | None], index: int, *, busy: set[_Worker]) -> _Worker | None:
        target = pinned[index]
        if target is not None:
            if target.live:
                return target
            pinned[index] = None  # its worker died: any worker will do
        idle = [w for w in self._live() if w not in busy]
        if not idle:
            return None
        return max(idle, key=lambda w: w.rate if w.rate is not None else 0.0)

    async def _parameters_ref(self, session_id: str, parameters: ParameterSet) -> ray.ObjectRef:
        cached = self._parameter_refs.get(session_id)
        if cached is not None and cached[0] == parameters.version:
            return cached[1]
        ref = await asyncio.get_running_loop().run_in_executor(None, _put, parameters)
        self._parameter_refs[session_id] = (parameters.version, ref)
        return ref

    async def _wait_for_live(self) -> None:
        deadline = time.monotonic() + self._worker_wait_s
        while not self._live():
            if not self._started:
                raise NoWorkersError("ComputeGradients: the worker pool is closed")
            if time.monotonic() >= deadline:
                raise NoWorkersError(f"ComputeGradients: no live worker (waited {self._worker_wait_s:g} s "
                                     "for a replacement); try again later")
            await asyncio.sleep(0.05)

    # ----------------------------------------------------------------------------- workers
    def _live(self) -> list[_Worker]:
        return [s.worker for s in self._slots if s.worker is not None and s.worker.live]

    def _connect(self) -> dict[str, float]:
        """Blocking: joins or starts Ray; returns the cluster's resources."""
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"include_dashboard": False, **self._ray_init_kwargs}
            try:
                ray.init(address=self._ray_address or "local", **kwargs)
            except (ConnectionError, RuntimeError, ValueError, ray_errors.RayError) as error:
                what = f"join Ray at {self._ray_address}" if self._ray_address else "start a local Ray"
                raise NoWorkersError(f"WorkerPool.start: cannot {what}: {error}") from None
            self._owns_ray = True
            logger.info("pool: %s Ray at %s", "joined" if self._ray_address else "started an embedded",
                        self._ray_address or ray.get_runtime_context().gcs_address)
        elif self._ray_address:
            logger.warning("pool: this process is already connected to Ray; ignoring ray_address %s",
                           self._ray_address)
        return dict(ray.cluster_resources())

    def _spawn(self, slot: _Slot) -> None:
        if self._actor_class is None:
            # Concurrency groups belong to the actor class (Ray's stubs do not list the keyword);
            # everything else is an option.
            remote = ray.remote(concurrency_groups={CONTROL_GROUP: 1})  # type: ignore[call-overload]
            self._actor_class = remote(GradientWorker).options(**self._actor_options)
        handle = self._actor_class.remote(name=f"ray-worker-{slot.index}", plugins=self._plugins,
                                          num_threads=self._cpus_per_worker, use_gpu=self._gpu)
        worker = _Worker(slot=slot.index, handle=handle)
        slot.worker = worker
        task = asyncio.create_task(self._come_up(slot, worker), name=f"psg-pool-start-{slot.index}")
        slot.tasks.add(task)
        task.add_done_callback(slot.tasks.discard)

    async def _come_up(self, slot: _Slot, worker: _Worker) -> None:
        try:
            description = await _future(worker.handle.describe.remote())
        except ray_errors.RayError as error:
            logger.warning("pool: worker %d failed to start: %s", slot.index, error)
            self._evict(worker, "failed to start")
            return
        if slot.worker is worker and self._started:
            worker.description = description
            worker.live = True
            slot.failures = 0
            logger.info("pool: worker %s up on %s (%s)", description.id, description.device, description.node)

    def _evict(self, worker: _Worker, reason: str) -> None:
        """Marks a worker dead, kills its actor and schedules a replacement in its slot."""
        slot = self._slots[worker.slot] if worker.slot < len(self._slots) else None
        if slot is None or slot.worker is not worker:
            return  # already replaced
        was_live, worker.live = worker.live, False
        self._kill(worker)
        slot.worker = None
        if not self._started:
            return
        # A worker lost after it came up is replaced at once; one that fails to start probably
        # will again, so those restarts back off, doubling up to 30 s.
        slot.failures = 0 if was_live else slot.failures + 1
        delay = 0.0 if slot.failures == 0 else min(30.0, 0.5 * 2 ** (slot.failures - 1))
        slot.restart_at = time.monotonic() + delay
        logger.warning("pool: worker %d evicted (%s); replacement in %.1f s", slot.index, reason, delay)
        if delay == 0.0:
            self._spawn(slot)

    @staticmethod
    def _kill(worker: _Worker) -> None:
        try:
            ray.kill(worker.handle, no_restart=True)
        except (ray_errors.RayError, ValueError) as error:  # already gone
            logger.debug("pool: kill of worker %d: %s", worker.slot, error)

    async def _watch(self) -> None:
        """Restarts empty slots when their backoff ends and probes live workers."""
        while self._started:
            now = time.monotonic()
            for slot in self._slots:
                if slot.worker is None and now >= slot.restart_at:
                    self._spawn(slot)
            live = self._live()
            probes = [asyncio.wait_for(_future(w.handle.ping.remote()), self._probe_timeout_s) for w in live]
            outcomes = await asyncio.gather(*probes, return_exceptions=True)
            for worker, outcome in zip(live, outcomes):
                if isinstance(outcome, (ray_errors.RayError, asyncio.TimeoutError)):
                    self._evict(worker, f"probe failed: {type(outcome).__name__}")
            await asyncio.sleep(self._probe_interval_s)


def _future(ref: ray.ObjectRef) -> asyncio.Future[Any]:
    """An asyncio future of an object reference (no blocking ``ray.get``)."""
    return asyncio.wrap_future(ref.future())


def _cancel(ref: ray.ObjectRef) -> None:
    try:
        ray.cancel(ref)
    except (ray_errors.RayError, ValueError) as error:  # finished, or its worker is gone
        logger.debug("pool: cancel: %s", error)


def _put(value: Shard | ParameterSet) -> ray.ObjectRef:
    """Blocking: ``value`` into the object store, its tensors as raw out-of-band bytes."""
    return ray.put(TensorPayload(value))


def _proportional_sizes(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` split into ``len(weights) <= total`` parts >= 1 in proportion to ``weights``
    (largest remainder; ties go to the earlier part, so equal weights give ``divmod``'s split).

    >>> _proportional_sizes(10, [1.0, 1.0, 1.0]), _proportional_sizes(10, [2.0, 1.0])
    ([4, 3, 3], [7, 3])
    """
    scale = sum(weights)
    quotas = [total * w / scale for w in weights]
    sizes = [max(1, int(q)) for q in quotas]
    by_remainder = sorted(range(len(sizes)), key=lambda i: (-(quotas[i] - int(quotas[i])), i))
    for i in by_remainder[:max(0, total - sum(sizes))]:
        sizes[i] += 1
    while sum(sizes) > total:  # parts raised to 1 are paid for by the largest
        largest = max(range(len(sizes)), key=lambda i: (sizes[i], i))
        sizes[largest] -= 1
    return sizes


def _recut(shards: Sequence[Shard], sizes: Sequence[int], K: int, batch_dim: int) -> list[Shard]:
    """The shards' samples cut again into runs of ``sizes`` samples: a run inside one shard is a view
    of it (:class:`~psg_server.worker.TensorPayload` sends only the view's bytes), a run across
    shards new tensors."""
    spans, start = [], 0
    for shard in shards:
        samples = shard.targets.shape[batch_dim] // K
        spans.append((start, start + samples))
        start += samples
    pieces, start = [], 0
    for index, size in enumerate(sizes):
        end = start + size
        inputs: list[list[torch.Tensor]] = [[] for _ in shards[0].inputs]
        targets: list[torch.Tensor] = []
        for shard, (first, stop) in zip(shards, spans):
            low, high = max(start, first), min(end, stop)
            if low >= high:
                continue
            for parts, tensor in zip(inputs, shard.inputs):
                parts.append(tensor.narrow(batch_dim, (low - first) * K, (high - low) * K))  # (n*K, ...)
            targets.append(shard.targets.narrow(batch_dim, (low - first) * K, (high - low) * K))  # (n*K, ...)
        pieces.append(Shard(index=index, inputs=tuple(_joined(parts, batch_dim) for parts in inputs),
                            targets=_joined(targets, batch_dim)))
        start = end
    return pieces


def _joined(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)
