"""Supervision of the pool's Ray actors: membership, placement, liveness, replacement, and the health
they add up to.

:class:`ActorSupervisor` keeps one :class:`~psg_server.worker.GradientWorker` actor per slot. Unless
the number of actors is fixed, the slots follow the cluster: one per GPU of the live nodes (or per
``cpus_per_worker`` CPUs when the cluster has no GPU), re-read every ``probe_interval_s`` from the
GCS node table (:func:`psg_server.cluster.live_nodes`, not Ray's resource totals, which keep a node
that left for a while). Workers that join a running cluster get actors, and workers that leave
take theirs along, without a restart of the frontend.

Each actor is placed on a node chosen here (hard node affinity): the live node with the most room
for another actor, never one that drains. A GPU actor asks Ray for a whole GPU, or, when a fixed
number of workers outnumbers the cluster's GPUs, for a share of one
(:func:`psg_server.placement.gpus_per_worker`: ``ceil(workers / gpus)`` actors per GPU), decided
once from the nodes the pool first sees; a node's room counts its CPUs too. An actor that has not
come up within ``place_timeout_s`` (Ray could not place it: the resources it asks for are held by
others, or exist on no node) is killed with an error that says what it asked for and what the
cluster has, and its slot is retried with the backoff below; when no actor at all came up that way,
:meth:`ActorSupervisor.start` raises that error instead of returning a pool that never serves. A node where an actor became unreachable (its raylet or
container gone: Ray answers ActorUnavailableError long before it declares the node dead, tens of
seconds later) gets no actor for a while; one where an actor died otherwise (its process killed,
the node fine) comes after the other nodes with room.

An actor is live once it has described itself. It is evicted (killed, and its slot refilled) when
the dispatch loop saw its shard fail because its process or node is gone; when its node drains or
leaves (the dispatch loop then sends its running shard elsewhere at once, instead of waiting for Ray
to fail it: a stopped container drains for up to 30 s, and is declared dead later still); or when
a probe fails or goes unanswered for ``probe_timeout_s`` (``ping`` answers from the actor's control
thread, so a long shard does not delay it). A slot whose actor had come up is refilled at once; one
whose actor died while starting backs off, doubling up to 30 s (it would probably fail again).
:attr:`ActorSupervisor.ready` (started, and a live actor) is what the health status follows.

The actors run with :data:`WORKER_ENV`, so their C allocator keeps the memory a shard frees for the
next one instead of handing it back and faulting it in again every step.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray import exceptions as ray_errors
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from psg_server.cluster import NodeView, live_nodes
from psg_server.errors import NoWorkersError
from psg_server.executor import WorkerDescription
from psg_server.placement import gpus_per_worker, whole_gpus, workers_per_gpu
from psg_server.scheduler import observe_rate
from psg_server.transport import as_future
from psg_server.channel import DirectChannel, local_node_id
from psg_server.worker import CONTROL_GROUP, WATCH_GROUP, GradientWorker

__all__ = ["WORKER_ENV", "ActorSupervisor", "SupervisedActor"]

logger = logging.getLogger(__name__)

#: How long close() waits for the direct channels' teardowns (seconds; Ray's own bound is 30 s per
#: actor still running a call).
_CHANNEL_TEARDOWN_S = 35.0

#: Environment of the actor processes, unless this process sets the variable itself. A DP step
#: allocates hundreds of MB (activations, per-sample gradients) and frees them at its end. glibc's
#: malloc serves large blocks with fresh ``mmap`` s (always above 32 MB, and in a thread's own
#: arena above 64 MB) and unmaps them on free, so each step faults all of it in again and the
#: kernel zeroes it: 40% of a 1024-sample CNN step on one core, more than linearly in the shard
#: size. One arena, no ``mmap`` for blocks and trimming only above 1 GiB free make a worker keep
#: and reuse its working set, as a caching allocator would (its memory stays at its peak). glibc
#: reads these at process start; other C libraries ignore them.
WORKER_ENV = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}

#: How long a node where an actor was lost comes last when placing actors, and a node where an
#: actor became unreachable gets none: its raylet may be gone although the GCS still lists it
#: (Ray's health checks take up to ~30 s to declare it dead).
LOST_NODE_PENALTY_S = 60.0

#: Errors that say an actor cannot be reached, rather than that its process died: its node may be
#: gone.
_UNREACHABLE: tuple[type[BaseException], ...] = (ray_errors.ActorUnavailableError, ray_errors.NodeDiedError)

#: A placement answer: every usable node is full (a fixed count above the cluster's size, or a
#: cluster that shrank); the slot waits for room.
_NO_ROOM = "no-room"


@dataclass(eq=False)
class SupervisedActor:
    """One actor in a slot. A replacement is a new ``SupervisedActor``; identity tells them apart."""

    slot: int
    handle: Any
    #: The node it runs on (hex node id): where it was placed, or found from its description; None
    #: when Ray placed it and it has not described itself yet.
    node_id: str | None = None
    #: Who and where the actor is; set when it comes up.
    description: WorkerDescription | None = None
    live: bool = False
    #: EWMA of samples per second (None until its first non-empty shard).
    rate: float | None = None
    #: Its direct channel for small steps (psg_server.channel), when it has one.
    channel: DirectChannel | None = None

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
    """Keeps the pool's gradient actors alive and placed (see the module docstring).

    Args:
        plugins: model plugin modules the actors load.
        cpus_per_worker: CPU cores Ray reserves for each actor, and its torch threads.
        start_timeout_s: how long :meth:`start` waits for the actors to come up.
        probe_interval_s: seconds between liveness probes and between reads of the cluster's nodes.
        probe_timeout_s: an actor that does not answer a probe this long is replaced.
        place_timeout_s: an actor that has not come up this long after it was created (Ray could
            not place it, or its start hangs) is killed with an error naming what it asked for.
        direct_channels: give each actor on this process's node a direct channel for small steps
            (:mod:`psg_server.channel`) once it is up.
    """

    def __init__(self, *, plugins: tuple[str, ...], cpus_per_worker: int, start_timeout_s: float,
                 probe_interval_s: float, probe_timeout_s: float, place_timeout_s: float = 90.0,
                 direct_channels: bool = False) -> None:
        self._plugins = plugins
        self._direct_channels = direct_channels
        #: Channels closed whose teardown may still run (close() waits for them).
        self._closed_channels: list[DirectChannel] = []
        self._cpus_per_worker = cpus_per_worker
        self._start_timeout_s = start_timeout_s
        self._place_timeout_s = place_timeout_s
        self._probe_interval_s = probe_interval_s
        self._probe_timeout_s = probe_timeout_s
        self._slots: dict[int, _Slot] = {}
        #: Fixed number of actors; None = as many as the live nodes have room for.
        self._count: int | None = None
        #: GPU or CPU actors; None until the cluster shows a node with a GPU or CPUs to decide by.
        self._use_gpu: bool | None = None
        #: GPU actors: the share of a GPU each asks Ray for, and how many share one GPU; decided
        #: once, from the first view of the nodes (:meth:`_decide_gpu_share`).
        self._gpu_share: float | None = None
        self._per_gpu = 1
        #: The last error of an actor that did not come up within place_timeout_s.
        self._placement_error: str | None = None
        #: The live nodes by id, as last read; None before the first read (Ray then places actors).
        self._nodes: dict[str, NodeView] | None = None
        #: Node id -> when an actor was last lost there (see LOST_NODE_PENALTY_S).
        self._lost: dict[str, float] = {}
        #: Node id -> when an actor there last became unreachable (no actor placed there meanwhile).
        self._unreachable: dict[str, float] = {}
        self._actor_class: Any = None
        self._actor_options: dict[str, Any] = {}
        self._running = False
        self._monitor: asyncio.Task[None] | None = None
        self._probes: dict[SupervisedActor, asyncio.Task[None]] = {}
        # Set (and replaced by a fresh event) whenever an actor comes up or is evicted, or the
        # supervisor stops: wakes every waiter of that moment at once.
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
        return [slot.actor for _, slot in sorted(self._slots.items())
                if slot.actor is not None and slot.actor.live]

    def find(self, worker_id: str) -> SupervisedActor | None:
        """The live actor whose description has ``worker_id``, if any."""
        return next((a for a in self.live() if a.description is not None and a.description.id == worker_id),
                    None)

    async def start(self, *, count: int | None, use_gpu: bool | None) -> None:
        """Starts the actors and the monitor.

        Args:
            count: actors to keep; None = as many as the live nodes have room for, following the
                cluster as nodes join and leave.
            use_gpu: one GPU per actor; None = when a live node has a GPU (decided once, by the
                first nodes with room for an actor).

        Returns when the actors placed are all up, or after ``start_timeout_s`` with whichever are
        up (the rest keep starting).

        Raises:
            NoWorkersError: ``use_gpu`` is True and no live node has a GPU; or no actor came up
                because every one that was started failed to be placed within ``place_timeout_s``
                (the message says what they asked for and what the cluster has).
        """
        if self._running:
            return
        nodes = await self._read_nodes()
        if use_gpu and nodes is not None and not any(n.resources.get("GPU", 0) >= 1 for n in nodes):
            raise NoWorkersError("WorkerPool.start: use_gpus=True, but the Ray cluster has no GPU")
        self._count, self._use_gpu = count, use_gpu
        self._changed = asyncio.Event()
        self._running = True
        self._placement_error = None
        if count is not None:
            self._slots = {index: _Slot(index) for index in range(count)}
        self._apply(nodes)
        starting = [task for slot in self._slots.values() for task in slot.tasks]
        if starting:
            await asyncio.wait(starting, timeout=self._start_timeout_s)
        if not self.live() and self._placement_error is not None:
            error = self._placement_error
            await self.close()
            raise NoWorkersError(f"WorkerPool.start: no worker came up: {error}")
        self._monitor = asyncio.create_task(self._watch(), name="psg-pool-monitor")
        logger.info("pool: %d of %d %s worker(s) live%s", len(self.live()), len(self._slots), self._kind(),
                    "" if count is not None else ", following the cluster's nodes")
        waiting = sum(1 for slot in self._slots.values() if slot.actor is None and not slot.failures)
        if waiting and self._nodes is not None:
            logger.warning("pool: the cluster's nodes have no room for %d more %s worker(s) (%s); they start when "
                           "a node with room joins", waiting, self._kind(), self._cluster_resources())

    async def close(self) -> None:
        """Stops the monitor and kills the actors."""
        self._running = False
        if self._monitor is not None:
            self._monitor.cancel()
            await asyncio.gather(self._monitor, return_exceptions=True)
            self._monitor = None
        for probe in list(self._probes.values()):
            probe.cancel()
        self._probes.clear()
        for slot in self._slots.values():
            for task in list(slot.tasks):
                task.cancel()
            if slot.actor is not None:
                slot.actor.live = False  # a step still running sends nothing more to it
                self._kill(slot.actor)
                slot.actor = None
        self._slots = {}
        self._actor_class = None
        self._gpu_share, self._per_gpu = None, 1
        self._notify()
        # The direct channels' teardowns end before this returns (so before the loop can close).
        channels, self._closed_channels = self._closed_channels, []
        done = await asyncio.gather(*(channel.wait_closed(_CHANNEL_TEARDOWN_S) for channel in channels))
        if not all(done):
            logger.warning("pool: %d direct channel(s) not torn down within %g s", done.count(False),
                           _CHANNEL_TEARDOWN_S)

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

    async def wait_changed(self) -> None:
        """Returns at the next change of the live actors (one came up or was evicted), or when the
        supervisor stops; at once when it is not running."""
        if self._changed is not None:
            await self._changed.wait()

    def evict(self, actor: SupervisedActor, reason: str, *, cause: BaseException | None = None,
              node_gone: bool = False) -> None:
        """Marks an actor dead, kills it and schedules a replacement in its slot: at once, or after
        the backoff when it died while starting.

        Args:
            actor: the actor; nothing happens when its slot holds another one already.
            reason: for the log.
            cause: the error that showed the loss; one saying the actor is unreachable keeps
                actors off its node for a while (the node may be dead before Ray says so).
            node_gone: its node drains or left, which says nothing about the actor: no backoff,
                and the slot is resized before it is filled (:meth:`_apply`).
        """
        slot = self._slots.get(actor.slot)
        if slot is None or slot.actor is not actor:
            return  # already replaced
        was_live, actor.live = actor.live, False
        self._kill(actor)
        slot.actor = None
        if actor.node_id is not None:
            self._lost[actor.node_id] = time.monotonic()
            if isinstance(cause, _UNREACHABLE):
                self._unreachable[actor.node_id] = time.monotonic()
        self._notify()
        if not self._running:
            return
        if node_gone:
            logger.warning("pool: worker %d evicted (%s)", slot.index, reason)
            return
        # An actor lost after it came up is replaced at once; one that fails to start probably
        # will again, so those restarts back off, doubling up to 30 s.
        slot.failures = 0 if was_live else slot.failures + 1
        delay = 0.0 if slot.failures == 0 else min(30.0, 0.5 * 2 ** (slot.failures - 1))
        slot.restart_at = time.monotonic() + delay
        logger.warning("pool: worker %d evicted (%s); replacement in %.1f s", slot.index, reason, delay)
        if delay == 0.0:
            self._spawn(slot)

    # ------------------------------------------------------------------------------ membership
    async def _read_nodes(self) -> list[NodeView] | None:
        """The live nodes, or None when the GCS did not answer (the caller keeps its last view)."""
        try:
            return await asyncio.get_running_loop().run_in_executor(None, live_nodes)
        except Exception as error:  # noqa: BLE001 - any GCS failure: try again next round
            logger.debug("pool: reading the cluster's nodes failed: %s", error)
            return None

    def _apply(self, nodes: list[NodeView] | None) -> None:
        """Takes a new view of the nodes: evicts actors whose node drains or left, decides GPU or
        CPU actors (once), resizes the slots to the room the nodes have (unless fixed) and fills
        the empty ones."""
        if nodes is not None:
            previous = self._nodes
            self._nodes = {node.node_id: node for node in nodes}
            if previous is not None:
                self._log_membership(previous, self._nodes)
            usable = {node.node_id for node in nodes if not node.draining}
            for slot in list(self._slots.values()):
                actor = slot.actor
                if actor is None:
                    continue
                if actor.node_id is None and actor.description is not None:
                    actor.node_id = self._node_of(actor.description)
                if actor.node_id is not None and actor.node_id not in usable:
                    why = "its node is draining" if actor.node_id in self._nodes else "its node left the cluster"
                    self.evict(actor, why, node_gone=True)
            self._lost = {node: when for node, when in self._lost.items() if node in self._nodes}
            self._unreachable = {node: when for node, when in self._unreachable.items() if node in self._nodes}
            if self._use_gpu is None:
                self._use_gpu = self._decide_device()
            if self._use_gpu and self._gpu_share is None:
                self._decide_gpu_share()
        self._resize()
        now = time.monotonic()
        if self._use_gpu is not None:
            for slot in list(self._slots.values()):
                if slot.actor is None and now >= slot.restart_at:
                    self._spawn(slot)

    def _decide_device(self) -> bool | None:
        usable = [node for node in (self._nodes or {}).values() if not node.draining]
        if any(node.resources.get("GPU", 0) >= 1 for node in usable):
            return True
        if any(node.resources.get("CPU", 0) >= self._cpus_per_worker for node in usable):
            return False
        return None  # nothing to run on yet: decide when a worker joins

    def _decide_gpu_share(self) -> None:
        """Sizes the GPU actors' requests by the usable nodes' GPUs (once; a cluster that shows no
        whole GPU yet leaves it undecided, and no GPU actor starts until one does)."""
        gpus = whole_gpus(node.resources.get("GPU", 0) for node in (self._nodes or {}).values() if not node.draining)
        if gpus < 1:
            return
        self._gpu_share = gpus_per_worker(self._count, gpus, use_gpu=True)
        self._per_gpu = workers_per_gpu(self._count, gpus)
        if self._per_gpu > 1:
            logger.warning("pool: %d GPU workers on %d GPU(s): %d share each GPU (num_gpus=%g each)", self._count,
                           gpus, self._per_gpu, self._gpu_share)

    def _capacity(self, node: NodeView) -> int:
        """How many actors ``node`` has room for, ours and others': its GPUs times the actors that
        share one (GPU actors; as many as its CPUs hold, too), or its CPUs over ``cpus_per_worker``."""
        if node.draining or self._use_gpu is None:
            return 0
        by_cpus = int(node.resources.get("CPU", 0) // self._cpus_per_worker)
        if self._use_gpu:
            return min(int(node.resources.get("GPU", 0)) * self._per_gpu, by_cpus)
        return by_cpus

    def _resize(self) -> None:
        """Follows the cluster (no fixed count): as many slots as the usable nodes have room for.
        Only slots without a live actor are dropped (the highest first)."""
        if self._count is not None or self._nodes is None:
            return
        target = sum(self._capacity(node) for node in self._nodes.values())
        if len(self._slots) < target:
            free = (index for index in range(target + len(self._slots)) if index not in self._slots)
            added = [next(free) for _ in range(target - len(self._slots))]
            for index in added:
                self._slots[index] = _Slot(index)
            logger.info("pool: the cluster has room for %d %s worker(s): adding %d", target, self._kind(),
                        len(added))
        elif len(self._slots) > target:
            idle = [slot for _, slot in sorted(self._slots.items(), reverse=True)
                    if slot.actor is None or not slot.actor.live]
            dropped = idle[:len(self._slots) - target]
            for slot in dropped:
                self._drop(slot)
            if dropped:
                logger.info("pool: the cluster has room for %d %s worker(s): dropped %d empty slot(s)", target,
                            self._kind(), len(dropped))

    def _drop(self, slot: _Slot) -> None:
        for task in list(slot.tasks):
            task.cancel()
        if slot.actor is not None:
            self._kill(slot.actor)
        del self._slots[slot.index]

    def _place(self) -> str | None:
        """The node for a new actor: the usable one with the most room, nodes that lost an actor
        lately last, none where an actor became unreachable lately; None = no view of the nodes
        (Ray places it), :data:`_NO_ROOM` = all full."""
        if self._nodes is None:
            return None
        taken = collections.Counter(slot.actor.node_id for slot in self._slots.values() if slot.actor is not None)
        now = time.monotonic()
        best: tuple[bool, int] | None = None
        chosen = _NO_ROOM
        for node in self._nodes.values():
            room = self._capacity(node) - taken[node.node_id]
            if room <= 0 or now - self._unreachable.get(node.node_id, -LOST_NODE_PENALTY_S) < LOST_NODE_PENALTY_S:
                continue
            key = (now - self._lost.get(node.node_id, -LOST_NODE_PENALTY_S) >= LOST_NODE_PENALTY_S, room)
            if best is None or key > best:
                best, chosen = key, node.node_id
        return chosen

    def _node_of(self, description: WorkerDescription) -> str | None:
        """The node id a worker's description names (``<ip>/<first 12 hex digits of the id>``)."""
        prefix = description.node.rpartition("/")[2]
        matches = [node for node in (self._nodes or {}) if prefix and node.startswith(prefix)]
        return matches[0] if len(matches) == 1 else None

    def _log_membership(self, previous: dict[str, NodeView], current: dict[str, NodeView]) -> None:
        for node_id in current.keys() - previous.keys():
            logger.info("pool: node %s joined the cluster (%s)", node_id[:12], _resources(current[node_id]))
        for node_id in previous.keys() - current.keys():
            logger.info("pool: node %s left the cluster", node_id[:12])
        for node_id in current.keys() & previous.keys():
            if current[node_id].draining and not previous[node_id].draining:
                logger.info("pool: node %s is draining", node_id[:12])

    def _kind(self) -> str:
        return {True: "GPU", False: f"{self._cpus_per_worker}-CPU", None: "(CPU or GPU, once a node has room)"}[
            self._use_gpu]

    def _request(self) -> dict[str, float]:
        """The resources each actor asks Ray for."""
        return {"CPU": float(self._cpus_per_worker), "GPU": (self._gpu_share or 0.0) if self._use_gpu else 0.0}

    def _cluster_resources(self) -> str:
        """The usable nodes' CPUs and GPUs, as last read (for messages)."""
        usable = [node for node in (self._nodes or {}).values() if not node.draining]
        totals = {name: sum(node.resources.get(name, 0) for node in usable) for name in ("CPU", "GPU")}
        return f"{len(usable)} usable node(s) with {totals['CPU']:g} CPU, {totals['GPU']:g} GPU"

    # ----------------------------------------------------------------------------------- actors
    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event() if self._running else None

    def _spawn(self, slot: _Slot) -> None:
        if self._use_gpu and self._gpu_share is None:
            return  # no view of the nodes' GPUs yet to size the request by; _apply tries again
        node_id = self._place()
        if node_id == _NO_ROOM:
            return  # the slot stays empty; _apply tries again when the nodes change
        if self._actor_class is None:
            self._actor_options = {
                "num_cpus": self._cpus_per_worker, "num_gpus": self._gpu_share if self._use_gpu else 0,
                # The supervisor replaces dead actors itself (possibly elsewhere); the dispatch
                # loop retries their shards.
                "max_restarts": 0, "max_task_retries": 0,
                # Shards run one at a time; probes answer from their own thread meanwhile.
                "max_concurrency": 1,
                "runtime_env": {"env_vars": {name: os.environ.get(name, value)
                                             for name, value in WORKER_ENV.items()}},
            }
            # Concurrency groups belong to the actor class (Ray's stubs do not list the keyword);
            # everything else is an option.
            remote = ray.remote(concurrency_groups={CONTROL_GROUP: 1, WATCH_GROUP: 1})  # type: ignore[call-overload]
            self._actor_class = remote(GradientWorker)
        # Hard affinity: a node that dies before the actor starts fails it (and the slot is placed
        # again), instead of leaving it pending there until Ray declares the node dead.
        strategy: Any = "SPREAD" if node_id is None else NodeAffinitySchedulingStrategy(node_id, soft=False)
        handle = self._actor_class.options(**self._actor_options, scheduling_strategy=strategy).remote(
            name=f"ray-worker-{slot.index}", plugins=self._plugins, num_threads=self._cpus_per_worker,
            use_gpu=bool(self._use_gpu))
        actor = SupervisedActor(slot=slot.index, handle=handle, node_id=node_id)
        slot.actor = actor
        task = asyncio.create_task(self._come_up(slot, actor), name=f"psg-pool-start-{slot.index}")
        slot.tasks.add(task)
        task.add_done_callback(slot.tasks.discard)

    async def _come_up(self, slot: _Slot, actor: SupervisedActor) -> None:
        try:
            description = await asyncio.wait_for(as_future(actor.handle.describe.remote()), self._place_timeout_s)
        except ray_errors.ActorUnschedulableError as error:  # Ray refused the request outright
            if slot.actor is actor and self._running:
                refusal = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                await self._not_placed(slot, actor, f"cannot be placed ({refusal})")
            return
        except ray_errors.RayError as error:
            logger.warning("pool: worker %d failed to start: %s", slot.index, error)
            self.evict(actor, "failed to start")
            return
        except asyncio.TimeoutError:
            if slot.actor is actor and self._running:
                await self._not_placed(slot, actor, f"did not come up within {self._place_timeout_s:g} s")
            return
        if slot.actor is actor and self._running:
            actor.description = description
            actor.live = True
            if actor.node_id is None:
                actor.node_id = self._node_of(description)
            slot.failures = 0
            logger.info("pool: worker %s up on %s (%s)", description.id, description.device, description.node)
            self._open_channel(actor)
            self._notify()

    def _open_channel(self, actor: SupervisedActor) -> None:
        """A direct channel to ``actor`` when enabled and it runs on this process's node; an actor
        whose graph fails to compile keeps ordinary calls (logged)."""
        if not self._direct_channels or actor.node_id is None or actor.node_id != local_node_id():
            return
        name = actor.description.id if actor.description is not None else f"worker {actor.slot}"
        try:
            actor.channel = DirectChannel.open(actor.handle, name)
        except Exception as error:  # noqa: BLE001 (Ray's compiled graphs are optional here)
            logger.warning("pool: no direct channel to %s (%s: %s); it gets ordinary actor calls", name,
                           type(error).__name__, error)

    async def _not_placed(self, slot: _Slot, actor: SupervisedActor, what: str) -> None:
        """An actor Ray did not place (``what``: refused, or not up within ``place_timeout_s``):
        logs the error (what it asks for, where, what the cluster has and has free, Ray's state of
        the actor), keeps it for :meth:`start`, and evicts the actor (its slot backs off)."""
        def ask_ray() -> tuple[str, dict[str, float]]:
            state = "unknown"
            try:  # the GCS actor table (Ray's public state API needs the dashboard)
                from ray._private import state as ray_state

                state = str(ray_state.actors(actor.handle._actor_id.hex()).get("State", "unknown"))
            except Exception as error:  # noqa: BLE001 - only words for the message
                logger.debug("pool: reading worker %d's state failed: %s", slot.index, error)
            try:
                free = {name: float(value) for name, value in ray.available_resources().items()
                        if name in ("CPU", "GPU")}
            except Exception:  # noqa: BLE001 - only words for the message
                free = {}
            return state, free

        state, free = await asyncio.get_running_loop().run_in_executor(None, ask_ray)
        if slot.actor is not actor or not self._running:
            return  # replaced or closed meanwhile
        request = ", ".join(f"{value:g} {name}" for name, value in self._request().items() if value)
        where = f"on node {actor.node_id[:12]}" if actor.node_id else "anywhere"
        free_text = ", ".join(f"{free.get(name, 0.0):g} {name}" for name in ("CPU", "GPU"))
        self._placement_error = (
            f"worker {slot.index} {what} (Ray's state: {state}): it asks Ray for {request} {where}, and the "
            f"cluster has {self._cluster_resources()} ({free_text} free). Ray places an actor only where all it "
            "asks for is free, and waits until it is: other actors or jobs hold what it needs, or no node has "
            "it. Use fewer --workers or --cpus-per-worker, --device cpu, or free the cluster's GPUs")
        logger.error("pool: %s", self._placement_error)
        self.evict(actor, "not placed")

    def _kill(self, actor: SupervisedActor) -> None:
        try:
            ray.kill(actor.handle, no_restart=True)
        except (ray_errors.RayError, ValueError) as error:  # already gone
            logger.debug("pool: kill of worker %d: %s", actor.slot, error)
        if actor.channel is not None:
            actor.channel.close()
            self._closed_channels = [c for c in self._closed_channels if not c.torn_down] + [actor.channel]

    async def _watch(self) -> None:
        """Reads the nodes (evicting actors of nodes that drain or left, resizing, refilling slots)
        and probes live actors, every ``probe_interval_s``. A probe runs as a task of its own, so
        one that hangs (its node unreachable) holds up neither the others nor the membership."""
        while self._running:
            self._apply(await self._read_nodes())
            for actor in self.live():
                if actor not in self._probes:
                    self._probes[actor] = asyncio.create_task(self._probe(actor),
                                                              name=f"psg-pool-probe-{actor.slot}")
            await asyncio.sleep(self._probe_interval_s)

    async def _probe(self, actor: SupervisedActor) -> None:
        try:
            await asyncio.wait_for(as_future(actor.handle.ping.remote()), self._probe_timeout_s)
        except (ray_errors.RayError, asyncio.TimeoutError) as error:
            self.evict(actor, f"probe failed: {type(error).__name__}", cause=error)
        finally:
            self._probes.pop(actor, None)


def _resources(node: NodeView) -> str:
    shown = {name: node.resources[name] for name in ("CPU", "GPU") if node.resources.get(name)}
    return ", ".join(f"{value:g} {name}" for name, value in shown.items()) or "no CPU or GPU"
