"""How much GPU each of the pool's actors asks Ray for: a GPU of its own, or a share of one.

Ray places an actor only where its whole request fits, and otherwise leaves it pending, without a
word, for as long as nothing frees: a pool of more GPU workers than the cluster has GPUs
(``--workers 3`` on a 1-GPU host) asking ``num_gpus=1`` each would start one worker and wait for
ever on the others. :func:`gpus_per_worker` is the rule the supervisor
(:mod:`psg_server.supervisor`) sizes its requests by:

* CPU workers ask for no GPU: ``--device cpu`` (``use_gpu=False``), or ``--device auto``
  (``use_gpu=None``) on a cluster without a whole GPU.
* GPU workers ask for a whole GPU each when there are at least as many GPUs as workers, and when
  the pool follows the cluster (no fixed count: one worker per GPU).
* Otherwise ``ceil(workers / gpus)`` workers share each GPU and each asks for ``1/that``, rounded
  down to Ray's resource granularity (:data:`RAY_RESOURCE_UNIT`) so that they fit. ``gpus /
  workers`` would not do: Ray puts a fractional request on one GPU, so three workers of 2/3 GPU
  cannot be placed on two GPUs, while three of 1/2 can (two on one GPU, one on the other).

Workers that share a GPU each hold a CUDA context and a caching allocator of their own, and their
kernels take turns on the device: sharing makes a pool of that size run, not run faster.

>>> gpus_per_worker(2, 4, use_gpu=None), gpus_per_worker(3, 1, use_gpu=None), gpus_per_worker(3, 2, use_gpu=True)
(1.0, 0.3333, 0.5)
>>> gpus_per_worker(3, 1, use_gpu=False), gpus_per_worker(3, 0, use_gpu=None), gpus_per_worker(None, 8, use_gpu=None)
(0.0, 0.0, 1.0)
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from psg_server.errors import NoWorkersError

__all__ = ["RAY_RESOURCE_UNIT", "gpus_per_worker", "whole_gpus", "workers_per_gpu"]

#: Ray's granularity of fractional resources: a request is a whole number of these.
RAY_RESOURCE_UNIT = 1e-4
_UNITS = 10_000  # 1 / RAY_RESOURCE_UNIT, as an integer: shares are computed exactly


def whole_gpus(counts: Iterable[float]) -> int:
    """The whole GPUs of the nodes whose GPU resource counts are ``counts`` (a node that advertises
    a fraction of a GPU holds no whole one)."""
    return sum(int(count) for count in counts)


def workers_per_gpu(workers: int | None, gpus: int) -> int:
    """How many of ``workers`` actors share each of ``gpus`` GPUs: 1 when each can have its own
    (or ``workers`` is None: one per GPU), else ``ceil(workers / gpus)``.

    Raises:
        ValueError: ``gpus`` < 1, or ``workers`` < 1.
    """
    if gpus < 1:
        raise ValueError(f"workers_per_gpu: needs at least one GPU, got {gpus}")
    if workers is None or workers <= gpus:
        if workers is not None and workers < 1:
            raise ValueError(f"workers_per_gpu: workers must be >= 1 or None, got {workers}")
        return 1
    return math.ceil(workers / gpus)


def gpus_per_worker(workers: int | None, gpus: float, *, use_gpu: bool | None) -> float:
    """Ray's ``num_gpus`` for each actor of a pool of ``workers`` (None: one per GPU) on a cluster
    with ``gpus`` GPUs (see the module docstring).

    Args:
        workers: the pool's fixed worker count, or None when it follows the cluster.
        gpus: the GPUs of the usable nodes (only whole ones count).
        use_gpu: True (``--device cuda``), False (``--device cpu``) or None (``auto``: GPU workers
            when the cluster has a whole GPU).

    Raises:
        NoWorkersError: ``use_gpu`` is True and the cluster has no whole GPU, or more than 10,000
            workers would share one GPU (Ray cannot request less than :data:`RAY_RESOURCE_UNIT`).
    """
    whole = int(gpus)
    if use_gpu is False or (use_gpu is None and whole < 1):
        return 0.0
    if whole < 1:
        raise NoWorkersError("WorkerPool.start: use_gpus=True, but the Ray cluster has no GPU")
    sharing = workers_per_gpu(workers, whole)
    if sharing > _UNITS:
        raise NoWorkersError(f"WorkerPool.start: {workers} workers on {whole} GPU(s) would ask Ray for less than "
                             f"{RAY_RESOURCE_UNIT:g} GPU each; use fewer workers")
    return (_UNITS // sharing) / _UNITS
