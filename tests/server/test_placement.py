"""How much GPU the pool's actors ask Ray for (psg_server.placement) and how the supervisor sizes its
slots by it: a GPU each, a share of one when a fixed count outnumbers the GPUs, none for CPU
workers; and no GPU actor before the nodes' GPUs are known. Without Ray: the Ray cases (an actor
Ray cannot place is a clear error, GPU workers sharing a GPU) are in test_pool.py."""

from __future__ import annotations

import math

import pytest

from psg_server.cluster import NodeView
from psg_server.errors import NoWorkersError
from psg_server.placement import RAY_RESOURCE_UNIT, gpus_per_worker, whole_gpus, workers_per_gpu
from psg_server.supervisor import ActorSupervisor, _Slot


@pytest.mark.parametrize(("workers", "gpus", "use_gpu", "expected"), [
    (1, 1, None, 1.0),  # a GPU each
    (2, 4, True, 1.0),
    (None, 8, None, 1.0),  # following the cluster: one worker per GPU
    (2, 1, None, 0.5),  # the 1-GPU host with 2 workers
    (3, 1, True, 0.3333),  # rounded down to Ray's unit, so that three fit
    (3, 2, None, 0.5),  # ceil(3/2) = 2 per GPU, not 2/3 each (which would not fit on 2 GPUs)
    (5, 2, True, 0.3333),
    (8, 4, True, 1 / 2),
    (3, 1, False, 0.0),  # --device cpu: no GPU asked of Ray, whatever the cluster has
    (3, 0, None, 0.0),  # auto on a cluster without GPUs: CPU workers
    (2, 0.5, None, 0.0),  # half a GPU is no whole one
])
def test_gpus_per_worker(workers: int | None, gpus: float, use_gpu: bool | None, expected: float) -> None:
    assert gpus_per_worker(workers, gpus, use_gpu=use_gpu) == expected


@pytest.mark.parametrize("gpus", [1, 2, 3, 8])
def test_shared_requests_always_fit_the_gpus(gpus: int) -> None:
    """Ray puts a fractional request on one GPU: the workers fit when each GPU holds its share of
    them, for any count."""
    for workers in range(1, 64):
        share = gpus_per_worker(workers, gpus, use_gpu=True)
        per_gpu = workers_per_gpu(workers, gpus)
        assert per_gpu * gpus >= workers  # room for every worker
        assert per_gpu * share <= 1.0 + 1e-12  # and each GPU holds its workers' requests
        assert share == 1.0 or share * per_gpu > 1.0 - per_gpu * RAY_RESOURCE_UNIT  # no more left idle than rounding
        assert math.isclose(share / RAY_RESOURCE_UNIT, round(share / RAY_RESOURCE_UNIT))  # a whole number of units


def test_impossible_gpu_requests_are_errors() -> None:
    with pytest.raises(NoWorkersError, match="use_gpus=True, but the Ray cluster has no GPU"):
        gpus_per_worker(2, 0, use_gpu=True)
    with pytest.raises(NoWorkersError, match="less than 0.0001 GPU each"):
        gpus_per_worker(10_001, 1, use_gpu=True)
    with pytest.raises(ValueError, match="at least one GPU"):
        workers_per_gpu(2, 0)
    with pytest.raises(ValueError, match="workers must be >= 1"):
        workers_per_gpu(0, 2)
    assert whole_gpus([1.0, 0.5, 2.0, 0.0]) == 3


def supervisor(count: int | None, spawned: list[int], *, cpus_per_worker: int = 1) -> ActorSupervisor:
    """A supervisor of ``count`` slots (None: following the nodes) that records the slots it would
    start an actor in (``spawned``) instead of starting one: placement is what is checked."""
    made = ActorSupervisor(plugins=(), cpus_per_worker=cpus_per_worker, start_timeout_s=1.0,
                           probe_interval_s=1.0, probe_timeout_s=1.0)
    made._count = count
    made._slots = {index: _Slot(index) for index in range(count or 0)}
    made._spawn = lambda slot: spawned.append(slot.index)  # type: ignore[method-assign]
    return made


def test_a_fixed_count_above_the_gpus_shares_them_and_fits_the_nodes() -> None:
    """The 1-GPU host with 3 GPU workers: each asks for a third of the GPU, and the node has room for
    three (it had room for one with a GPU each, and the other two waited for ever)."""
    spawned: list[int] = []
    pool = supervisor(3, spawned)
    pool._use_gpu = None  # auto
    pool._apply([NodeView("gpu-host", {"CPU": 16.0, "GPU": 1.0})])
    assert pool._use_gpu is True and pool._gpu_share == 0.3333 and pool._per_gpu == 3
    assert pool._request() == {"CPU": 1.0, "GPU": 0.3333}
    assert pool._capacity(NodeView("gpu-host", {"CPU": 16.0, "GPU": 1.0})) == 3
    assert pool._place() == "gpu-host"
    assert spawned == [0, 1, 2]  # every slot is filled
    # A node's room counts its CPUs too: two GPUs but one CPU hold one 1-CPU worker.
    assert pool._capacity(NodeView("few-cpus", {"CPU": 1.0, "GPU": 2.0})) == 1


def test_cpu_workers_ask_for_no_gpu_on_a_gpu_host() -> None:
    """--device cpu on a GPU host: CPU workers by CPUs, no GPU in the request."""
    spawned: list[int] = []
    pool = supervisor(3, spawned, cpus_per_worker=2)
    pool._use_gpu = False
    pool._apply([NodeView("gpu-host", {"CPU": 16.0, "GPU": 1.0})])
    assert pool._gpu_share is None and pool._request() == {"CPU": 2.0, "GPU": 0.0}
    assert spawned == [0, 1, 2]
    assert pool._capacity(NodeView("gpu-host", {"CPU": 16.0, "GPU": 1.0})) == 8


def test_following_the_cluster_is_a_gpu_each() -> None:
    spawned: list[int] = []
    pool = supervisor(None, spawned)
    pool._use_gpu = None
    pool._apply([NodeView("a", {"CPU": 64.0, "GPU": 2.0}), NodeView("b", {"CPU": 64.0, "GPU": 4.0}),
                 NodeView("c", {"CPU": 64.0, "GPU": 8.0}, draining=True)])
    assert pool._gpu_share == 1.0 and pool._per_gpu == 1
    assert sorted(pool._slots) == spawned == list(range(6))  # an actor per GPU of the usable nodes


def test_no_gpu_actor_before_the_nodes_gpus_are_known() -> None:
    """With GPU actors asked for but no view of the nodes (the GCS did not answer), nothing is
    placed: the request could not be sized, and a whole GPU each might never fit."""
    spawned: list[int] = []
    pool = supervisor(2, spawned)
    del pool._spawn  # the real one, up to its placement
    pool._use_gpu = True
    pool._running = True

    def place() -> str | None:
        raise AssertionError("a GPU actor was placed before its request was sized")

    pool._place = place  # type: ignore[method-assign]  # the first thing _spawn does past its guard
    pool._apply(None)
    assert pool._gpu_share is None
    assert all(slot.actor is None and not slot.tasks for slot in pool._slots.values())
    pool._spawn = lambda slot: spawned.append(slot.index)  # type: ignore[method-assign]
    pool._apply([NodeView("gpu-host", {"CPU": 8.0, "GPU": 1.0})])  # the nodes answer: sized, then placed
    assert pool._gpu_share == 0.5 and spawned == [0, 1]
