"""The Ray worker pool: exact results for any worker count, balancing, the parameter cache, worker
loss (ray.kill and SIGKILL mid-step), membership (the pool follows the live nodes: joins, draining
nodes, placement), deadlines, no-worker errors and health, and the flags that select it. All tests
that start actors share the session's local Ray (``ray_session`` in tests/conftest.py)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import platform
import signal
import tempfile
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from psg_client import GradientClient, ServiceError
from psg_core.config import DPConfig, DPGradient
from psg_server.cluster import NodeView
from psg_server.config import ServerConfig
from psg_server.errors import NoWorkersError
from psg_server.executor import InProcessExecutor, ParameterSet, SessionSpec, Shard
from psg_server.models import default_registry
from psg_server.scheduler import ShardPlan, cut_shards, plan_shards, proportional_sizes
from tests.devices import requires_cuda
from tests.server.service_harness import FAST_RETRY, MLP_KWARGS, build, client_for, local_dp, mlp_batch, serve
from tests.waiting import wait_for_lines, wait_until

MODES = ("hooks", "functorch", "ew", "ghost")
PLUGIN = "tests.server.pool_models"
#: Forward-pass sleep of the slow model: long enough to kill a worker while its shard runs.
SLOW_MS = 800


class LoopThread:
    """An event loop on a thread: pools live on it, tests call into it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def submit(self, coroutine: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def call(self, coroutine: Coroutine[Any, Any, Any], timeout: float = 120.0) -> Any:
        return self.submit(coroutine).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    running = LoopThread()
    yield running
    running.close()


def worker_channels(pool: Any) -> list[bool]:
    """Whether each live worker has a usable direct channel (psg_server.channel)."""
    return [a.channel is not None and a.channel.usable for a in pool._supervisor.live()]


def make_pool(loop_thread: LoopThread, **kwargs: Any) -> Any:
    """A started pool with ``kwargs``' workers, CPU workers unless told otherwise: the tests compare
    with references computed on the CPU, and must run the same on a GPU host (the session's Ray
    sees its GPUs: GPU workers there are the business of the tests that ask for them)."""
    from psg_server.pool import WorkerPool

    kwargs.setdefault("use_gpus", False)
    kwargs.setdefault("plugins", (PLUGIN,))
    kwargs.setdefault("probe_interval_s", 0.5)
    kwargs.setdefault("start_timeout_s", 60.0)
    pool = WorkerPool(**kwargs)
    loop_thread.call(pool.start())
    assert pool.ready and len(pool.workers()) == kwargs.get("num_workers", 1)
    return pool


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda n: f"{n}workers")
def pool(request: pytest.FixtureRequest, ray_session: Any, loop_thread: LoopThread) -> Iterator[Any]:
    started = make_pool(loop_thread, num_workers=request.param)
    yield started
    loop_thread.call(started.close())


@pytest.fixture
def signals() -> Iterator[Path]:
    """A directory for files the workers write to signal the test (model kwargs hold strings of at
    most 64 characters, too few for ``tmp_path``)."""
    with tempfile.TemporaryDirectory(prefix="psg-") as path:
        yield Path(path)


@pytest.fixture(scope="module")
def reference(loop_thread: LoopThread) -> Iterator[InProcessExecutor]:
    executor = InProcessExecutor(default_registry((PLUGIN,)), num_workers=1, device="cpu")  # "auto" takes a GPU
    loop_thread.call(executor.start())
    yield executor
    loop_thread.call(executor.close())


def session_spec(config: DPConfig, *, session_id: str = "session", model: str = "mlp",
                 kwargs: dict[str, Any] | None = None) -> SessionSpec:
    registry = default_registry((PLUGIN,))
    parsed = registry.parse_kwargs(model, json.dumps(MLP_KWARGS if kwargs is None else kwargs))
    return SessionSpec(session_id=session_id, model=model,
                       model_kwargs_json=json.dumps(parsed, sort_keys=True), loss="cross_entropy",
                       dp_config=config, plugins=(PLUGIN,))


def parameters_of(model: torch.nn.Module, version: int = 1) -> ParameterSet:
    return ParameterSet(version=version, tensors={n: p.detach().clone() for n, p in model.named_parameters()})


def shards_for(config: DPConfig, samples: int, num_shards: int | None = None, *, seed: int = 0,
               pool: Any = None) -> list[Shard]:
    """The batch of ``samples`` cut into ``num_shards`` even shards, or as the frontend would plan
    it for ``pool``'s workers."""
    K = config.augmentation_multiplicity
    inputs, targets = mlp_batch(samples * K, seed=seed)
    plan = (plan_shards(samples, pool.throughputs(), max_shard_samples=1024) if num_shards is None
            else ShardPlan.even(samples, num_shards))
    return cut_shards((inputs,), targets, plan, augmentation_multiplicity=K, batch_first=True)


def slow_model(session_id: str, started_file: Path) -> tuple[SessionSpec, torch.nn.Module]:
    """A session of the slow plugin model whose workers append to ``started_file`` when a forward
    pass starts, and a local copy of the model (which does not)."""
    kwargs: dict[str, Any] = {"in_features": 6, "num_classes": 3, "delay_ms": SLOW_MS}
    spec = session_spec(DPConfig(max_grad_norm=0.5), session_id=session_id, model="slow_mlp",
                        kwargs={**kwargs, "started_file": str(started_file)})
    return spec, default_registry((PLUGIN,)).build("slow_mlp", kwargs)


def assert_same(results: list[DPGradient], expected: DPGradient, *, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    merged = DPGradient.merge(results)
    assert merged.grads.keys() == expected.grads.keys()
    for name, grad in merged.grads.items():
        torch.testing.assert_close(grad, expected.grads[name], rtol=rtol, atol=atol)
    torch.testing.assert_close(merged.per_sample_norms, expected.per_sample_norms, rtol=rtol, atol=atol)
    assert merged.loss_sum == pytest.approx(expected.loss_sum, rel=rtol)
    assert (merged.num_samples, merged.num_clipped) == (expected.num_samples, expected.num_clipped)


def live_actors(pool: Any) -> list[Any]:
    """The pool's live actors (test-only peek inside the pool's supervisor)."""
    return pool._supervisor.live()


def worker_handles(pool: Any) -> list[Any]:
    """The live workers' actor handles."""
    return [actor.handle for actor in live_actors(pool)]


# ------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("K", [1, 3])
@pytest.mark.parametrize("mode", MODES)
def test_pool_equals_in_process_executor(pool: Any, reference: InProcessExecutor, loop_thread: LoopThread,
                                         mode: str, K: int) -> None:
    config = DPConfig(mode=mode, augmentation_multiplicity=K, max_grad_norm=0.5)
    spec = session_spec(config, session_id=f"{mode}-{K}")
    model = build(seed=K)
    parameters = parameters_of(model)
    num_workers = len(pool.workers())
    shards = shards_for(config, 7, num_workers, seed=K)
    results = loop_thread.call(pool.run(spec, parameters, shards))
    expected = loop_thread.call(reference.run(spec, parameters, shards))
    assert_same(results, DPGradient.merge(expected))
    inputs = torch.cat([s.inputs[0] for s in shards])
    targets = torch.cat([s.targets for s in shards])
    assert_same(results, local_dp(model, inputs, targets, config))
    # every worker took part
    assert all(rate is not None and rate > 0 for rate in pool.throughputs().values())
    loop_thread.call(pool.release(spec.session_id))


def test_more_shards_than_workers_are_queued(pool: Any, reference: InProcessExecutor,
                                             loop_thread: LoopThread) -> None:
    config = DPConfig(augmentation_multiplicity=2, max_grad_norm=0.5)
    spec = session_spec(config, session_id="queued")
    parameters = parameters_of(build(seed=3))
    shards = shards_for(config, 9, len(pool.workers()) + 3)
    results = loop_thread.call(pool.run(spec, parameters, shards))
    assert len(results) == len(shards)
    assert_same(results, DPGradient.merge(loop_thread.call(reference.run(spec, parameters, shards))))
    loop_thread.call(pool.release(spec.session_id))


def test_fewer_samples_than_workers(pool: Any, reference: InProcessExecutor, loop_thread: LoopThread) -> None:
    config = DPConfig(augmentation_multiplicity=3, max_grad_norm=0.5)
    spec = session_spec(config, session_id="few")
    parameters = parameters_of(build(seed=7))
    shards = shards_for(config, 2, pool=pool)  # planned as the frontend does
    assert [s.worker is not None for s in shards] == [True] * min(2, len(pool.workers()))
    results = loop_thread.call(pool.run(spec, parameters, shards))
    assert [r.num_samples for r in results] == ([2] if len(pool.workers()) == 1 else [1, 1])
    assert_same(results, DPGradient.merge(loop_thread.call(reference.run(spec, parameters, shards))))
    loop_thread.call(pool.release(spec.session_id))


def test_an_empty_batch_is_one_empty_shard(pool: Any, reference: InProcessExecutor,
                                           loop_thread: LoopThread) -> None:
    # Poisson sampling draws empty batches: the step still runs (and gets its noise on the frontend).
    config = DPConfig(max_grad_norm=0.5)
    spec = session_spec(config, session_id="empty")
    parameters = parameters_of(build(seed=8))
    shards = shards_for(config, 0, pool=pool)
    assert [(s.worker, s.targets.shape[0]) for s in shards] == [(None, 0)]
    results = loop_thread.call(pool.run(spec, parameters, shards))
    assert [r.num_samples for r in results] == [0]
    assert_same(results, DPGradient.merge(loop_thread.call(reference.run(spec, parameters, shards))))
    loop_thread.call(pool.release(spec.session_id))


@pytest.mark.parametrize("pool", [2, 3], indirect=True, ids=lambda n: f"{n}workers")  # balancing needs >= 2
def test_uneven_workers_get_shares_proportional_to_throughput(pool: Any, reference: InProcessExecutor,
                                                              loop_thread: LoopThread) -> None:
    actors = live_actors(pool)
    assert len(actors) >= 2
    config = DPConfig(max_grad_norm=0.5)
    for actor, rate in zip(actors, (300.0, 100.0, 100.0)):
        actor.rate = rate
    shards = shards_for(config, 12, pool=pool)
    sizes = [s.targets.shape[0] for s in shards]
    assert [s.worker for s in shards] == [w.id for w in pool.workers()]
    assert sizes == proportional_sizes(12, [a.rate for a in actors])
    assert sizes[0] > sizes[1] and sizes[0] > 12 // len(actors)
    spec = session_spec(config, session_id="uneven")
    parameters = parameters_of(build(seed=4))
    results = loop_thread.call(pool.run(spec, parameters, shards))
    assert [r.num_samples for r in results] == sizes
    assert_same(results, DPGradient.merge(loop_thread.call(reference.run(spec, parameters, shards))))
    loop_thread.call(pool.release(spec.session_id))


def _fault_in_large_blocks(worker: Any, megabytes: int) -> tuple[dict[str, str | None], list[int]]:
    """Runs inside an actor: its allocator settings, and the page faults of each of a few rounds of
    allocating and freeing ``megabytes``-sized tensors (after a first round warmed the heap)."""
    import resource

    from psg_server.pool import WORKER_ENV

    def round_() -> int:
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        for _ in range(3):
            block = torch.empty(megabytes << 20, dtype=torch.uint8)
            block.fill_(1)
            del block
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before

    round_()
    return {name: os.environ.get(name) for name in WORKER_ENV}, [round_() for _ in range(3)]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the allocator settings are glibc's")
def test_workers_reuse_freed_memory_instead_of_faulting_it_in_again(pool: Any) -> None:
    import ray

    from psg_server.pool import WORKER_ENV

    for handle in worker_handles(pool):
        env, faults = ray.get(handle.__ray_call__.remote(_fault_in_large_blocks, 80), timeout=60)
        assert env == WORKER_ENV
        # Unmapped on free, every round would fault in 3 blocks of 20480 fresh 4 KiB pages. Kept,
        # they are reused (the heap may still grow now and then, when other threads' allocations
        # split a free block, hence the best round).
        assert min(faults) < 1000, faults


def test_parameters_cross_ray_once_per_version_and_frozen_ones_once_per_frozen_version(
        pool: Any, loop_thread: LoopThread, monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    from psg_server import transport
    from psg_wire.flat import FlatTensors

    monkeypatch.setattr(transport, "INLINE_BYTES", 0)  # every buffer through the object store, to count them
    puts: list[tuple[str, ...]] = []
    original_put = ray.put

    def counting_put(value: Any, **kwargs: Any) -> Any:
        if isinstance(value, transport.TensorPayload) and isinstance(value.value, FlatTensors):
            puts.append(value.value.layout.names)
        return original_put(value, **kwargs)

    monkeypatch.setattr(ray, "put", counting_put)
    config = DPConfig(max_grad_norm=0.5)
    spec = session_spec(config, session_id="versions")
    shards = shards_for(config, 6, len(pool.workers()))
    inputs, targets = torch.cat([s.inputs[0] for s in shards]), torch.cat([s.targets for s in shards])
    frozen = frozenset({"0.weight", "0.bias"})  # as a LoRA run's base model: pushed once, kept after
    first, second, third = build(seed=5), build(seed=6), build(seed=7)

    def version(model: torch.nn.Module, number: int, frozen_from: int, held: torch.nn.Module) -> ParameterSet:
        tensors = {n: (dict(held.named_parameters())[n] if n in frozen else p).detach().clone()
                   for n, p in model.named_parameters()}
        return ParameterSet(version=number, tensors=tensors, frozen_version=frozen_from, frozen=frozen)

    steps = [(version(first, 1, 1, first), first), (version(first, 1, 1, first), first),
             (version(second, 2, 1, first), None), (version(third, 3, 3, third), third)]
    for parameters, model in steps:
        results = loop_thread.call(pool.run(spec, parameters, shards))
        if model is None:  # version 2: second's trainable parameters on first's frozen ones
            model = build(seed=6)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    param.copy_(parameters.tensors[name])
        assert_same(results, local_dp(model, inputs, targets, config))
    varying, fixed = ("2.weight", "2.bias"), ("0.weight", "0.bias")
    assert puts == [varying, fixed, varying, varying, fixed]
    stats = [ray.get(handle.stats.remote(), timeout=30) for handle in worker_handles(pool)]
    assert all("versions" in s["sessions"] for s in stats)
    loop_thread.call(pool.release(spec.session_id))
    stats = [ray.get(handle.stats.remote(), timeout=30) for handle in worker_handles(pool)]
    assert all("versions" not in s["sessions"] for s in stats)


def test_small_parameter_sets_and_shards_ride_inside_the_calls(pool: Any, loop_thread: LoopThread,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    puts: list[Any] = []
    original_put = ray.put
    monkeypatch.setattr(ray, "put", lambda value, **kwargs: puts.append(value) or original_put(value, **kwargs))
    config = DPConfig(max_grad_norm=0.5)
    spec = session_spec(config, session_id="inline")
    shards = shards_for(config, 6, len(pool.workers()))
    model = build(seed=8)
    results = loop_thread.call(pool.run(spec, parameters_of(model, 1), shards))
    assert puts == []
    inputs, targets = torch.cat([s.inputs[0] for s in shards]), torch.cat([s.targets for s in shards])
    assert_same(results, local_dp(model, inputs, targets, config))
    # Each result is one flat buffer, with the worker's timings.
    assert all(r.flat is not None and r.grads["2.weight"].data_ptr() == r.flat.buffer.data_ptr() + r.flat.layout.entries[2].offset for r in results)
    assert all(r.timings.compute > 0 for r in results if r.num_samples)
    loop_thread.call(pool.release(spec.session_id))


@pytest.mark.parametrize("pool", [2], indirect=True, ids=lambda n: f"{n}workers")
def test_small_steps_take_the_direct_channel(pool: Any, loop_thread: LoopThread,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from psg_server.channel import DirectChannel

    calls: list[int] = []
    original = DirectChannel.call

    async def counting(self: Any, packed: bytes) -> bytes:
        calls.append(len(packed))
        return await original(self, packed)

    monkeypatch.setattr(DirectChannel, "call", counting)
    config = DPConfig(max_grad_norm=0.5)
    model = build(seed=9)
    for direct_channels in (True, False):
        # Channels on: a pool of its own; off: the module's 2-worker pool, which make_pool started
        # with the same arguments but direct_channels (off by default).
        running = make_pool(loop_thread, num_workers=2, direct_channels=True) if direct_channels else pool
        spec = session_spec(config, session_id=f"channel-{direct_channels}")
        try:
            assert worker_channels(running) == [direct_channels] * 2
            calls.clear()
            shards = shards_for(config, 6, 2)
            results = loop_thread.call(running.run(spec, parameters_of(model, 1), shards))
            inputs, targets = torch.cat([s.inputs[0] for s in shards]), torch.cat([s.targets for s in shards])
            assert_same(results, local_dp(model, inputs, targets, config))
            assert len(calls) == (2 if direct_channels else 0)  # one call per shard, or none
        finally:
            if running is pool:
                loop_thread.call(pool.release(spec.session_id))
            else:
                loop_thread.call(running.close())


# ----------------------------------------------------------------------------- faults
@pytest.mark.parametrize("how, num_workers", [("ray_kill", 2), ("sigkill", 2), ("sigkill", 1),
                                              ("sigkill-channel", 2)])
def test_worker_killed_mid_step_costs_latency_not_the_step(ray_session: Any, loop_thread: LoopThread,
                                                           signals: Path, how: str, num_workers: int) -> None:
    # "sigkill-channel": the shards go through direct channels and no liveness probe runs during
    # the test, so only a channel's death watch can tell the dispatcher that the actor under its call
    # died (a compiled call whose actor dies never completes).
    channels = how == "sigkill-channel"
    pool = make_pool(loop_thread, num_workers=num_workers, direct_channels=channels,
                     **({"probe_interval_s": 600.0} if channels else {}))
    try:
        assert worker_channels(pool) == [channels] * num_workers
        started = signals / "forwards"
        spec, model = slow_model(f"kill-{how}", started)
        config = spec.dp_config
        parameters = parameters_of(model)
        shards = shards_for(config, 4, num_workers)
        inputs, targets = torch.cat([s.inputs[0] for s in shards]), torch.cat([s.targets for s in shards])
        expected = local_dp(model, inputs, targets, config)
        victim = worker_handles(pool)[0]
        pid = ray_session.get(victim.ping.remote(), timeout=30)
        step = loop_thread.submit(pool.run(spec, parameters, shards))
        # One shard per worker: every worker is inside its shard's forward pass once it has signalled.
        wait_for_lines(started, num_workers, 60, "every worker to start its shard")
        assert not step.done()
        if how == "ray_kill":
            ray_session.kill(victim, no_restart=True)
        else:
            os.kill(pid, signal.SIGKILL)
        assert_same(step.result(timeout=90), expected)
        wait_until(lambda: len(pool.workers()) == num_workers, 90, "the replacement worker")
        assert victim not in worker_handles(pool)
        assert_same(loop_thread.call(pool.run(spec, parameters, shards)), expected)
    finally:
        loop_thread.call(pool.close())


# ----------------------------------------------------------------------------- membership
class NodeTable:
    """Stands in for :func:`psg_server.cluster.live_nodes` (what the supervisor reads as the
    cluster's live nodes): the session's one real node, with the CPUs and draining state the test
    sets, so that the test can make workers join and nodes drain on a single host."""

    def __init__(self, node_id: str, cpus: float) -> None:
        self.node_id = node_id
        self.cpus = cpus
        self.draining = False

    def __call__(self, timeout_s: float = 5.0) -> list[NodeView]:
        return [NodeView(self.node_id, {"CPU": self.cpus, "memory": 1e9}, draining=self.draining)]


def test_the_pool_follows_the_live_nodes_without_a_restart(ray_session: Any, loop_thread: LoopThread,
                                                             signals: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from psg_server import supervisor
    from psg_server.pool import WorkerPool

    table = NodeTable(ray_session.get_runtime_context().get_node_id(), cpus=2.0)
    monkeypatch.setattr(supervisor, "live_nodes", table)
    # No num_workers: as many actors as the live nodes have room for. The session's Ray has 8 CPUs
    # in its resource totals; the node table says 2. CPU workers, which the table counts.
    pool = WorkerPool(plugins=(PLUGIN,), probe_interval_s=0.2, start_timeout_s=60.0, use_gpus=False)
    loop_thread.call(pool.start())
    try:
        assert [w.id for w in pool.workers()] == ["ray-worker-0", "ray-worker-1"]
        table.cpus = 3.0  # a worker node joins the running cluster
        wait_until(lambda: len(pool.workers()) == 3, 90, "an actor for the joined CPU, without a restart")

        started = signals / "forwards"
        spec, model = slow_model("drain", started)
        config = spec.dp_config
        parameters = parameters_of(model)
        shards = shards_for(config, 3, 3)
        inputs, targets = torch.cat([s.inputs[0] for s in shards]), torch.cat([s.targets for s in shards])
        expected = local_dp(model, inputs, targets, config)
        step = loop_thread.submit(pool.run(spec, parameters, shards))
        wait_for_lines(started, 3, 60, "a shard running on every worker")
        # The node drains (its `ray start` got SIGTERM): its actors go at once, although Ray would
        # let them run on (a draining node is alive until it stops, up to 30 s later), and no
        # actor is placed there while it drains.
        table.draining = True
        wait_until(lambda: not pool.workers(), 10, "the draining node's actors evicted")
        assert not step.done()
        # An actor still starting when the node began to drain has no node yet: it is evicted as
        # soon as it reports one (its live peers went at once, above).
        wait_until(lambda: all(slot.actor is None for slot in pool._supervisor._slots.values()), 10,
                   "no actor left in any slot while the only node drains")
        # A node with room comes back: the step's shards, sent again, all run there.
        table.draining, table.cpus = False, 1.0
        assert_same(step.result(timeout=120), expected)
        assert [w.id for w in pool.workers()] == ["ray-worker-0"]
    finally:
        loop_thread.call(pool.close())


def test_placement_skips_draining_nodes_and_puts_nodes_that_lost_an_actor_last() -> None:
    from psg_server.supervisor import LOST_NODE_PENALTY_S, ActorSupervisor, SupervisedActor, _Slot

    supervisor = ActorSupervisor(plugins=(), cpus_per_worker=2, start_timeout_s=1.0, probe_interval_s=1.0,
                                 probe_timeout_s=1.0)
    supervisor._use_gpu = False
    supervisor._nodes = {"a": NodeView("a", {"CPU": 4.0}), "b": NodeView("b", {"CPU": 2.0}),
                         "c": NodeView("c", {"CPU": 16.0}, draining=True), "head": NodeView("head", {"CPU": 0.0})}

    def occupy(node: str) -> None:
        index = len(supervisor._slots)
        supervisor._slots[index] = _Slot(index, actor=SupervisedActor(slot=index, handle=None, node_id=node))

    assert supervisor._place() == "a"  # the most room (2 actors of 2 CPUs); c drains
    supervisor._lost["a"] = time.monotonic()  # an actor was just lost there: the node may be dead
    assert supervisor._place() == "b"
    supervisor._lost["a"] = time.monotonic() - LOST_NODE_PENALTY_S
    assert supervisor._place() == "a"
    occupy("a")
    occupy("a")
    assert supervisor._place() == "b"
    occupy("b")
    assert supervisor._place() == "no-room"
    # An actor on "b" becomes unreachable (its container killed): while Ray still lists the node,
    # its slot is not placed there again, although it is the only node with room.
    from ray.exceptions import ActorUnavailableError

    (lost,) = [slot.actor for slot in supervisor._slots.values() if slot.actor is not None and slot.actor.node_id == "b"]
    supervisor._running = True  # as after start(); _spawn stays off: placement is what is checked
    supervisor._spawn = lambda slot: None  # type: ignore[method-assign]
    supervisor.evict(lost, "unreachable", cause=ActorUnavailableError("gone", None))
    assert supervisor._place() == "no-room"
    supervisor._unreachable["b"] -= LOST_NODE_PENALTY_S  # long enough without Ray declaring it dead
    assert supervisor._place() == "b"
    supervisor._nodes = None  # no view of the nodes: Ray places the actor
    assert supervisor._place() is None
    supervisor._use_gpu = True
    supervisor._nodes = {"a": NodeView("a", {"CPU": 64.0, "GPU": 2.0})}
    assert [supervisor._capacity(node) for node in supervisor._nodes.values()] == [2]


class _Holder:
    """An actor that only holds the resources it was created with."""

    def ping(self) -> int:
        return os.getpid()


def test_a_worker_ray_cannot_place_is_a_clear_error_not_a_wait(ray_session: Any, loop_thread: LoopThread) -> None:
    """Other actors hold every free CPU of the session's Ray (as the pool fixture's workers held the
    only GPU of a GPU host): the worker stays pending in Ray. It is killed after place_timeout_s,
    and start() says what it asked for and what the cluster has, instead of waiting for ever."""
    from psg_server.pool import WorkerPool

    holders: list[Any] = []

    def hold_free_cpus() -> int:
        free = int(ray_session.available_resources().get("CPU", 0))
        if free:
            holder = ray_session.remote(_Holder).options(num_cpus=free).remote()
            holders.append(holder)
            ray_session.get(holder.ping.remote(), timeout=60)
        return free

    try:
        # CPUs that earlier tests' actors give back late are taken too: none may stay free for the
        # pool's worker (it would be placed, and there would be nothing to time out).
        hold_free_cpus()
        quiet_since, give_up = time.monotonic(), time.monotonic() + 30
        while time.monotonic() - quiet_since < 1.5 and time.monotonic() < give_up:
            time.sleep(0.1)
            if hold_free_cpus():
                quiet_since = time.monotonic()
        pool = WorkerPool(plugins=(PLUGIN,), num_workers=1, use_gpus=False, place_timeout_s=2.0, start_timeout_s=60.0,
                          probe_interval_s=0.2)
        evicted: list[str] = []  # the actors the pool gave up on, by Ray id
        evict = pool._supervisor.evict

        def recording_evict(actor: Any, reason: str, **kwargs: Any) -> None:
            evicted.append(actor.handle._actor_id.hex())
            evict(actor, reason, **kwargs)

        pool._supervisor.evict = recording_evict  # type: ignore[method-assign]
        started = time.monotonic()
        with pytest.raises(NoWorkersError) as failure:
            loop_thread.call(pool.start())
        assert time.monotonic() - started < 30  # the deadline, not start_timeout_s
        message = str(failure.value)
        assert message.startswith("WorkerPool.start: no worker came up: worker 0 did not come up within 2 s"), message
        assert "it asks Ray for 1 CPU on node" in message and "(0 CPU, " in message, message  # none free
        assert "--device cpu" in message
        assert not pool.ready and not live_actors(pool)
        # The pending actor was killed, not left to take the CPUs once they free.
        from ray._private import state as ray_state

        assert len(evicted) == 1
        wait_until(lambda: ray_state.actors(evicted[0])["State"] == "DEAD", 30, "the unplaced actor killed")
    finally:
        for holder in holders:
            ray_session.kill(holder, no_restart=True)


def test_a_worker_no_node_can_hold_is_a_clear_error(ray_session: Any, loop_thread: LoopThread,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The node table promises a node of 64 CPUs; Ray's node has 8, so a 16-CPU worker is
    infeasible there: Ray refuses it at once, and start() says so."""
    from psg_server import supervisor
    from psg_server.pool import WorkerPool

    monkeypatch.setattr(supervisor, "live_nodes", NodeTable(ray_session.get_runtime_context().get_node_id(), cpus=64))
    pool = WorkerPool(plugins=(PLUGIN,), num_workers=1, cpus_per_worker=16, use_gpus=False, start_timeout_s=60.0,
                      probe_interval_s=0.2)
    started = time.monotonic()
    with pytest.raises(NoWorkersError, match=r"^WorkerPool.start: no worker came up: worker 0 cannot be placed \(") \
            as failure:
        loop_thread.call(pool.start())
    assert time.monotonic() - started < 30
    assert "it asks Ray for 16 CPU on node" in str(failure.value) and "64 CPU, 0 GPU" in str(failure.value)
    assert not pool.ready


@requires_cuda
def test_gpu_workers_outnumbering_the_gpus_share_them(ray_session: Any, loop_thread: LoopThread,
                                                      reference: InProcessExecutor) -> None:
    """One worker more than the session's Ray has GPUs (2 on a 1-GPU host): with a GPU each, the last
    could never be placed; they share, all come up on a GPU, and a step is exact."""
    gpus = int(ray_session.cluster_resources().get("GPU", 0))
    if gpus < 1:
        pytest.skip("torch sees a CUDA device, but the session's Ray counts no GPU")
    pool = make_pool(loop_thread, num_workers=gpus + 1, use_gpus=True)
    try:
        workers = pool.workers()
        assert len(workers) == gpus + 1 and all(w.device.startswith("cuda:") for w in workers), workers
        config = DPConfig(augmentation_multiplicity=2, max_grad_norm=0.5)
        spec = session_spec(config, session_id="shared-gpus")
        parameters = parameters_of(build(seed=5))
        shards = shards_for(config, 2 * (gpus + 1), gpus + 1)
        results = loop_thread.call(pool.run(spec, parameters, shards))
        expected = DPGradient.merge(loop_thread.call(reference.run(spec, parameters, shards)))
        assert_same(results, expected, rtol=1e-4, atol=1e-5)  # GPU against the CPU reference
        assert all(rate is not None for rate in pool.throughputs().values())  # every worker took a shard
    finally:
        loop_thread.call(pool.close())


@pytest.mark.parametrize("direct_channels", [False, True])
def test_deadline_cancels_in_flight_shards(ray_session: Any, loop_thread: LoopThread, signals: Path,
                                          monkeypatch: pytest.MonkeyPatch, direct_channels: bool) -> None:
    # An actor call is cancelled with ray.cancel; a direct channel's call waits for the channel
    # (one call at a time) and is dropped before it is sent. Either way the shard never runs.
    pool = make_pool(loop_thread, num_workers=1, direct_channels=direct_channels)
    assert (worker_channels(pool) == [True]) == direct_channels
    cancelled: list[Any] = []
    original_cancel = ray_session.cancel

    def recording_cancel(ref: Any, **kwargs: Any) -> None:
        cancelled.append(ref)
        original_cancel(ref, **kwargs)

    monkeypatch.setattr(ray_session, "cancel", recording_cancel)
    try:
        started = signals / "forwards"
        spec, model = slow_model("deadline", started)
        config = spec.dp_config
        parameters = parameters_of(model)
        running = loop_thread.submit(pool.run(spec, parameters, shards_for(config, 2, 1)))
        wait_for_lines(started, 1, 60, "the first step's shard to start")
        # A second step queues behind the first (SLOW_MS in its forward pass) on the only worker,
        # and times out there.
        with pytest.raises(asyncio.TimeoutError):
            loop_thread.call(asyncio.wait_for(pool.run(spec, parameters, shards_for(config, 2, 1)), 0.3))
        assert len(cancelled) == (0 if direct_channels else 1)
        running.result(timeout=60)
        handle = worker_handles(pool)[0]
        assert ray_session.get(handle.stats.remote(), timeout=30)["shards_run"] == 1  # never ran
        loop_thread.call(pool.run(spec, parameters, shards_for(config, 2, 1)))  # still serving
    finally:
        loop_thread.call(pool.close())


def test_no_live_worker_is_unavailable_and_not_serving_until_one_returns(
        ray_session: Any, loop_thread: LoopThread, monkeypatch: pytest.MonkeyPatch) -> None:
    from psg_server.pool import WorkerPool

    # The server starts the pool on its own loop and closes it when it stops.
    pool = WorkerPool(num_workers=1, probe_interval_s=0.2, use_gpus=False)  # the default worker_wait_s, 30 s
    supervisor = pool._supervisor
    spawn = supervisor._spawn
    try:
        with serve(executor=pool) as server, GradientClient(server.target, retry=FAST_RETRY) as client:
            monkeypatch.setattr(supervisor, "_spawn", lambda slot: None)  # replacements cannot start for now
            health = health_pb2_grpc.HealthStub(grpc.insecure_channel(server.target))

            def status() -> int:
                return health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status

            assert status() == health_pb2.HealthCheckResponse.SERVING
            (worker,) = client.server_info().workers
            assert worker.id == "ray-worker-0" and worker.device == "cpu" and "/" in worker.node
            config = DPConfig(max_grad_norm=0.5)
            model = build()
            with client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy",
                                       expected_batch_size=4, config=config) as session:
                session.push_parameters(model)
                inputs, targets = mlp_batch(4)
                session.compute_gradients(inputs, targets)
                ray_session.kill(worker_handles(pool)[0], no_restart=True)
                wait_until(lambda: status() == health_pb2.HealthCheckResponse.NOT_SERVING, 30, "NOT_SERVING")
                started = time.monotonic()
                with pytest.raises(ServiceError) as failure:
                    session.compute_gradients(inputs, targets)
                # at once, not after worker_wait_s: a client with a shorter deadline must see UNAVAILABLE
                assert failure.value.code == grpc.StatusCode.UNAVAILABLE and "no live worker" in failure.value.details
                assert time.monotonic() - started < 10
                assert not client.server_info().workers
                monkeypatch.setattr(supervisor, "_spawn", spawn)
                wait_until(lambda: status() == health_pb2.HealthCheckResponse.SERVING, 90, "SERVING again")
                result = session.compute_gradients(inputs, targets)
            expected = local_dp(model, inputs, targets, config)
            for name, grad in result.grads.items():
                torch.testing.assert_close(grad, expected.grads[name] / 4, rtol=1e-5, atol=1e-6)
    finally:
        monkeypatch.setattr(supervisor, "_spawn", spawn)
    assert not pool.ready
    with pytest.raises(NoWorkersError, match="not running"):
        loop_thread.call(pool.run(session_spec(DPConfig()), parameters_of(build()),
                                  shards_for(DPConfig(), 2, 1)))


def test_accounting_runs_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    # PLD accounting can take a good fraction of a second: it must not stall other RPCs meanwhile.
    from psg_core.accounting import PrivacyAccountant

    original = PrivacyAccountant.epsilon
    accounting, finish_accounting = threading.Event(), threading.Event()

    def slow_epsilon(self: PrivacyAccountant, delta: float | None = None) -> float:
        accounting.set()
        finish_accounting.wait(timeout=30)  # held until the test has had its answer
        return original(self, delta)

    monkeypatch.setattr(PrivacyAccountant, "epsilon", slow_epsilon)
    with serve() as server, client_for(server) as client:
        config = DPConfig(max_grad_norm=0.5, noise_multiplier=1.0)
        with client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy",
                                   expected_batch_size=4, config=config, sample_rate=0.01,
                                   delta=1e-5) as session:
            session.push_parameters(build())
            inputs, targets = mlp_batch(4)
            step = threading.Thread(target=session.compute_gradients, args=(inputs, targets), daemon=True)
            step.start()
            assert accounting.wait(timeout=30), "the step never reached its accounting"
            started = time.monotonic()
            try:
                client.server_info()  # blocked for 30 s if the accounting held the event loop
            finally:
                answered = time.monotonic() - started
                finish_accounting.set()
            step.join(timeout=30)
            assert not step.is_alive() and session.info().steps == 1
    assert answered < 0.75, f"GetServerInfo waited {answered:.2f} s behind the accounting"


# ----------------------------------------------------------------- pure parts, flags
@pytest.mark.parametrize("batch_first", [True, False])
def test_shards_cut_from_a_batch_send_only_their_own_bytes(batch_first: bool) -> None:
    import pickle

    from psg_server.transport import TensorPayload

    K, samples = 3, 10
    batch_dim = 0 if batch_first else 1
    rows = torch.arange(samples * K, dtype=torch.float32)  # (N*K,)
    inputs = rows.view(-1, 1, 1).expand(-1, 2, 4) if batch_first else rows.view(1, -1, 1).expand(2, -1, 4)
    # targets follow the inputs' layout: (N*K,) batch first, (1, N*K) otherwise
    targets = rows.long() if batch_first else rows.long().view(1, -1)
    plan = plan_shards(samples, {"fast": 200.0, "slow": 100.0}, max_shard_samples=1024)
    assert plan.sizes == (7, 3)
    shards = cut_shards((inputs.contiguous(),), targets, plan, augmentation_multiplicity=K, batch_first=batch_first)
    assert [s.targets.flatten().tolist() for s in shards] == [list(range(21)), list(range(21, 30))]
    for shard in shards:
        torch.testing.assert_close(shard.inputs[0].select(1 - batch_dim, 0)[..., 0], shard.targets.flatten().float())
        # A shard is a view of the batch, but what travels is only the shard's own bytes.
        buffers: list[pickle.PickleBuffer] = []
        copy = pickle.loads(pickle.dumps(TensorPayload(shard), protocol=5, buffer_callback=buffers.append),
                            buffers=buffers)
        sent = sum(memoryview(b).nbytes for b in buffers)
        assert sent == shard.inputs[0].numel() * 4 + shard.targets.numel() * 8
        assert copy.worker == shard.worker and torch.equal(copy.inputs[0], shard.inputs[0])


def test_tensor_payload_round_trips_tensors_in_band_and_out_of_band() -> None:
    import pickle

    from psg_server.transport import TensorPayload

    rows = torch.randn(6, 5)  # (6, 5)
    tensors = {"bf16": torch.randn(3, 4).to(torch.bfloat16), "bool": torch.tensor([True, False]),
               "complex": torch.randn(2, 2, dtype=torch.complex64).conj(), "empty": torch.zeros(0, 5),
               "scalar": torch.tensor(3.5), "strided": rows[:, 1:4], "transposed": rows.t(),
               "negated": -rows[0], "int8": torch.arange(7, dtype=torch.int8),
               "grad": torch.ones(2, requires_grad=True)}
    value = DPGradient(grads=tensors, per_sample_norms=torch.rand(4), loss_sum=1.5, num_samples=4,
                       num_clipped=1)
    buffers: list[pickle.PickleBuffer] = []
    out_of_band = pickle.loads(pickle.dumps(TensorPayload(value), protocol=5, buffer_callback=buffers.append),
                               buffers=buffers)
    in_band = pickle.loads(pickle.dumps(TensorPayload(value), protocol=5))
    assert len(buffers) == len(tensors) - 1 + 1  # every grad but the one needing grad, and the norms
    for copy in (out_of_band, in_band):
        assert isinstance(copy, DPGradient)
        assert (copy.loss_sum, copy.num_samples, copy.num_clipped) == (1.5, 4, 1)
        assert torch.equal(copy.per_sample_norms, value.per_sample_norms)
        for name, tensor in tensors.items():
            got = copy.grads[name]
            assert got.dtype == tensor.dtype and got.shape == tensor.shape and torch.equal(got, tensor), name
        copy.grads["strided"].add_(1.0)  # fresh, writable memory
    assert torch.equal(tensors["strided"], rows[:, 1:4])
    shard = pickle.loads(pickle.dumps(TensorPayload(Shard(index=2, inputs=(rows[2:4],),
                                                          targets=torch.arange(2)))))
    assert isinstance(shard, Shard) and shard.index == 2 and torch.equal(shard.inputs[0], rows[2:4])


def test_flags_select_the_pool() -> None:
    environ = {"RAY_ADDRESS": "10.0.0.1:6379"}
    cli = ServerConfig.from_args(["--workers", "3", "--cpus-per-worker", "2"], environ=environ,
                                 defaults={"executor": "ray"})
    assert (cli.executor, cli.num_workers, cli.cpus_per_worker) == ("ray", 3, 2)
    assert cli.ray_address == "10.0.0.1:6379"
    flag = ServerConfig.from_args(["--ray-address", "h:1", "--executor", "inprocess"], environ=environ,
                                  defaults={"executor": "ray"})
    assert (flag.executor, flag.ray_address, flag.num_workers) == ("inprocess", "h:1", None)
    assert ServerConfig().executor == "inprocess"
    from_env = ServerConfig.from_args([], environ={"PSG_EXECUTOR": "inprocess"}, defaults={"executor": "ray"})
    assert from_env.executor == "inprocess"
    from psg_core.errors import ConfigError

    with pytest.raises(ConfigError, match="executor"):
        ServerConfig(executor="threads")
    with pytest.raises(ConfigError, match="cpus_per_worker"):
        ServerConfig(cpus_per_worker=0)
