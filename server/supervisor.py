"""Supervision of the pool's Ray actors: start, liveness, replacement, and the health they add up to.

:class:`ActorSupervisor` keeps one :class:`~psg_server.worker.GradientWorker` actor per slot. An
actor is live once it has described itself; the dispatch loop evicts one whose shard failed
because its process or node is gone, and a monitor probes every live actor (``ping`` answers from
the actor's control thread, so a long shard does not delay it) and evicts those that fail or do not
answer in time, so deaths between steps are noticed too. An evicted actor is killed and its slot
gets a replacement: at once when the actor had come up, after a backoff doubling up to 30 s when it
died while starting (it would probably fail again). :attr:`ActorSupervisor.ready` (started, and a
live actor) is what the health status follows.

The actors run with :data:`WORKER_ENV`, so their C allocator keeps the memory a shard frees for the
next one instead of handing it back and faulting it in again every step.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray import exceptions as ray_errors

from psg_server.errors import NoWorkersError
from psg_server.executor import WorkerDescription
from psg_server.scheduler import observe_rate
from psg_server.transport import as_future
from psg_server.worker import CONTROL_GROUP, GradientWorker

__all__ = ["WORKER_ENV", "ActorSupervisor", "SupervisedActor"]

logger = logging.getLogger(__name__)

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
class SupervisedActor:
    """One actor in a slot. A replacement is a new ``SupervisedActor``; identity tells them apart."""

    slot: int
    handle: Any
    #: Who and where the actor is; set when it comes up.
    description: WorkerDescription | None = None
    live: bool = False
    #: EWMA of samples per second (None until its first non-empty shard).
    rate: float | None = None

    def observe(self, samples: int, seconds: float) -> None:
        """Records that a shard of ``samples`` took ``seconds`` (an empty shard says nothing)."""
        if samples > 0:
            self.rate = observe_rate(self.rate, samples, seconds)


@dataclass(eq=False)
class _Slot:
    """A place for one actor; a dead actor's slot gets a replacement."""

    index: int
    actor: SupervisedActor | None = None
    #: Consecutive actors that died before coming up (drives the restart backoff).
    failures: int = 0
    restart_at: float = 0.0
    tasks: set[asyncio.Task[None]] = field(default_factory=set)


class ActorSupervisor:
    """Keeps ``count`` gradient actors alive (see the module docstring).

    Args:
        plugins: model plugin modules the actors load.
        cpus_per_worker: CPU cores Ray reserves for each actor, and its torch threads.
        start_timeout_s: how long :meth:`start` waits for the actors to come up.
        probe_interval_s: seconds between liveness probes.
        probe_timeout_s: an actor that does not answer a probe this long is replaced.
    """

    def __init__(self, *, plugins: tuple[str, ...], cpus_per_worker: int, start_timeout_s: float,
                 probe_interval_s: float, probe_timeout_s: float) -> None:
        self._plugins = plugins
        self._cpus_per_worker = cpus_per_worker
        self._start_timeout_s = start_timeout_s
        self._probe_interval_s = probe_interval_s
        self._probe_timeout_s = probe_timeout_s
        self._slots: list[_Slot] = []
        self._use_gpu = False
        self._actor_class: Any = None
        self._running = False
        self._monitor: asyncio.Task[None] | None = None
        # Set (and replaced by a fresh event) whenever an actor comes up or the supervisor stops:
        # wakes every waiter of that moment at once.
        self._changed: asyncio.Event | None = None

    @property
    def running(self) -> bool:
        """True between :meth:`start` and :meth:`close`."""
        return self._running

    @property
    def ready(self) -> bool:
        """True while running with at least one live actor."""
        return self._running and bool(self.live())

    def live(self) -> list[SupervisedActor]:
        """The live actors, by slot."""
        return [s.actor for s in self._slots if s.actor is not None and s.actor.live]

    def find(self, worker_id: str) -> SupervisedActor | None:
        """The live actor whose description has ``worker_id``, if any."""
        return next((a for a in self.live() if a.description is not None and a.description.id == worker_id),
                    None)

    async def start(self, *, count: int, use_gpu: bool) -> None:
        """Starts ``count`` actors (one GPU each when ``use_gpu``); returns when they are all up, or
        after ``start_timeout_s`` with whichever are up (the rest keep starting)."""
        if self._running:
            return
        self._use_gpu = use_gpu
        self._changed = asyncio.Event()
        self._slots = [_Slot(index) for index in range(count)]
        self._running = True
        for slot in self._slots:
            self._spawn(slot)
        starting = [task for slot in self._slots for task in slot.tasks]
        await asyncio.wait(starting, timeout=self._start_timeout_s)
        self._monitor = asyncio.create_task(self._watch(), name="psg-pool-monitor")
        logger.info("pool: %d of %d %s worker(s) live", len(self.live()), count,
                    "GPU" if use_gpu else f"{self._cpus_per_worker}-CPU")

    async def close(self) -> None:
        """Stops the monitor and kills the actors."""
        self._running = False
        if self._monitor is not None:
            self._monitor.cancel()
            await asyncio.gather(self._monitor, return_exceptions=True)
            self._monitor = None
        for slot in self._slots:
            for task in list(slot.tasks):
                task.cancel()
            if slot.actor is not None:
                self._kill(slot.actor)
                slot.actor = None
        self._slots = []
        self._actor_class = None
        self._notify()

    async def wait_for_live(self, timeout_s: float) -> None:
        """Returns once an actor is live; raises :class:`NoWorkersError` after ``timeout_s``, or when
        the supervisor stops meanwhile."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.live():
            if not self._running or self._changed is None:
                raise NoWorkersError("ComputeGradients: the worker pool is closed")
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise NoWorkersError(f"ComputeGradients: no live worker (waited {timeout_s:g} s for a "
                                     "replacement); try again later")
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass  # the loop raises with the message above

    def evict(self, actor: SupervisedActor, reason: str) -> None:
        """Marks an actor dead, kills it and schedules a replacement in its slot."""
        slot = self._slots[actor.slot] if actor.slot < len(self._slots) else None
        if slot is None or slot.actor is not actor:
            return  # already replaced
        was_live, actor.live = actor.live, False
        self._kill(actor)
        slot.actor = None
        if not self._running:
            return
        # An actor lost after it came up is replaced at once; one that fails to start probably
        # will again, so those restarts back off, doubling up to 30 s.
        slot.failures = 0 if was_live else slot.failures + 1
        delay = 0.0 if slot.failures == 0 else min(30.0, 0.5 * 2 ** (slot.failures - 1))
        slot.restart_at = time.monotonic() + delay
        logger.warning("pool: worker %d evicted (%s); replacement in %.1f s", slot.index, reason, delay)
        if delay == 0.0:
            self._spawn(slot)

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event() if self._running else None

    def _spawn(self, slot: _Slot) -> None:
        if self._actor_class is None:
            options = {
                "num_cpus": self._cpus_per_worker, "num_gpus": 1 if self._use_gpu else 0,
                # The supervisor replaces dead actors itself (possibly elsewhere); the dispatch
                # loop retries their shards.
                "max_restarts": 0, "max_task_retries": 0,
                # Shards run one at a time; probes answer from their own thread meanwhile.
                "max_concurrency": 1,
                "scheduling_strategy": "SPREAD",
                "runtime_env": {"env_vars": {name: os.environ.get(name, value)
                                             for name, value in WORKER_ENV.items()}},
            }
            # Concurrency groups belong to the actor class (Ray's stubs do not list the keyword);
            # everything else is an option.
            remote = ray.remote(concurrency_groups={CONTROL_GROUP: 1})  # type: ignore[call-overload]
            self._actor_class = remote(GradientWorker).options(**options)
        handle = self._actor_class.remote(name=f"ray-worker-{slot.index}", plugins=self._plugins,
                                          num_threads=self._cpus_per_worker, use_gpu=self._use_gpu)
        actor = SupervisedActor(slot=slot.index, handle=handle)
        slot.actor = actor
        task = asyncio.create_task(self._come_up(slot, actor), name=f"psg-pool-start-{slot.index}")
        slot.tasks.add(task)
        task.add_done_callback(slot.tasks.discard)

    async def _come_up(self, slot: _Slot, actor: SupervisedActor) -> None:
        try:
            description = await as_future(actor.handle.describe.remote())
        except ray_errors.RayError as error:
            logger.warning("pool: worker %d failed to start: %s", slot.index, error)
            self.evict(actor, "failed to start")
            return
        if slot.actor is actor and self._running:
            actor.description = description
            actor.live = True
            slot.failures = 0
            logger.info("pool: worker %s up on %s (%s)", description.id, description.device, description.node)
            self._notify()

    @staticmethod
    def _kill(actor: SupervisedActor) -> None:
        try:
            ray.kill(actor.handle, no_restart=True)
        except (ray_errors.RayError, ValueError) as error:  # already gone
            logger.debug("pool: kill of worker %d: %s", actor.slot, error)

    async def _watch(self) -> None:
        """Restarts empty slots when their backoff ends and probes live actors."""
        while self._running:
            now = time.monotonic()
            for slot in self._slots:
                if slot.actor is None and now >= slot.restart_at:
                    self._spawn(slot)
            live = self.live()
            probes = [asyncio.wait_for(as_future(a.handle.ping.remote()), self._probe_timeout_s) for a in live]
            outcomes = await asyncio.gather(*probes, return_exceptions=True)
            for actor, outcome in zip(live, outcomes):
                if isinstance(outcome, (ray_errors.RayError, asyncio.TimeoutError)):
                    self.evict(actor, f"probe failed: {type(outcome).__name__}")
            await asyncio.sleep(self._probe_interval_s)
