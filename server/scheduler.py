"""Shard planning: which samples of a step each worker computes (pure policy: no Ray, no asyncio).

The frontend asks :func:`plan_shards` for a :class:`ShardPlan` of the step's ``N`` samples, given
the executor's live workers and their measured throughputs, and cuts the batch with
:func:`cut_shards`. This module is the only place that decides shards; executors run the shards
they are given. The rules:

* A shard is a contiguous run of whole samples: the ``K`` rows ``n*K ... n*K+K-1`` of sample ``n``
  are never split, and the shards cover the batch once, in sample order, so merging their results
  in shard order equals ``dp_gradient`` on the whole batch.
* With at least as many workers as the batch needs shards of ``max_shard_samples``, every chosen
  worker gets one shard, sized in proportion to its throughput (an EWMA of samples/s,
  :func:`observe_rate`) and pinned to it; the fastest workers are chosen when there are more
  workers than samples. Throughputs within :data:`BALANCE_TOLERANCE` of each other count as equal
  (measurements are noisy), and a worker not measured yet counts as the mean of the others.
* Otherwise (a batch too large for one shard per worker, or a proportional shard above
  ``max_shard_samples``) the batch is cut into near-equal shards that no worker is pinned to: the
  executor hands each to whichever worker is free first, which balances by itself.

>>> plan = plan_shards(10, {"w0": 300.0, "w1": 100.0}, max_shard_samples=1024)
>>> plan.sizes, plan.workers
((8, 2), ('w0', 'w1'))
>>> import torch
>>> rows = torch.arange(20)  # (N*K,) with K = 2
>>> [s.targets.tolist() for s in cut_shards((rows.view(20, 1),), rows, ShardPlan.even(10, 3),
...                                         augmentation_multiplicity=2, batch_first=True)]
[[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13], [14, 15, 16, 17, 18, 19]]
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from psg_server.executor import Shard

__all__ = ["BALANCE_TOLERANCE", "EWMA_ALPHA", "ShardPlan", "cut_shards", "observe_rate", "plan_shards",
           "proportional_sizes"]

#: Workers whose throughputs are within this ratio get equal shares (measurements are noisy).
BALANCE_TOLERANCE = 1.25
#: Weight of the newest measurement in the throughput EWMA.
EWMA_ALPHA = 0.3


@dataclass(frozen=True)
class ShardPlan:
    """How a step's samples are cut: ``sizes[i]`` samples in shard ``i`` (in sample order), meant
    for the worker with id ``workers[i]`` (None: whichever worker is free first)."""

    sizes: tuple[int, ...]
    workers: tuple[str | None, ...]

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.workers):
            raise ValueError(f"ShardPlan: {len(self.sizes)} sizes but {len(self.workers)} workers")
        if any(size < 0 for size in self.sizes):
            raise ValueError(f"ShardPlan: shard sizes must be >= 0, got {list(self.sizes)}")

    @property
    def num_samples(self) -> int:
        """Samples covered by the plan."""
        return sum(self.sizes)

    @classmethod
    def even(cls, num_samples: int, num_shards: int) -> ShardPlan:
        """``num_samples`` in ``min(num_shards, num_samples)`` (at least one) near-equal shards, the
        larger ones first, pinned to no worker.

        >>> ShardPlan.even(10, 3).sizes, ShardPlan.even(2, 5).sizes, ShardPlan.even(0, 2).sizes
        ((4, 3, 3), (1, 1), (0,))
        """
        if num_samples < 0 or num_shards < 1:
            raise ValueError(f"ShardPlan.even: need num_samples >= 0 and num_shards >= 1, got {num_samples} "
                             f"and {num_shards}")
        count = max(1, min(num_shards, num_samples))
        base, extra = divmod(num_samples, count)
        return cls(sizes=tuple(base + (i < extra) for i in range(count)), workers=(None,) * count)


def plan_shards(num_samples: int, throughputs: Mapping[str, float | None], *,
                max_shard_samples: int) -> ShardPlan:
    """The shards of a step of ``num_samples`` samples (see the module docstring for the rules).

    Args:
        num_samples: samples N in the batch (each K rows); 0 gives one empty shard.
        throughputs: the live workers by id, in the executor's order (which breaks ties), with
            their throughput in samples/s, or None where not measured yet.
        max_shard_samples: the most samples one shard may hold, unless the batch has fewer shards'
            worth than there are workers.

    Returns:
        The plan; its sizes add up to ``num_samples``.

    >>> plan_shards(10, {"a": None, "b": None, "c": None}, max_shard_samples=4)
    ShardPlan(sizes=(4, 3, 3), workers=('a', 'b', 'c'))
    >>> plan_shards(10, {"a": None}, max_shard_samples=4)  # more shards than workers: a queue
    ShardPlan(sizes=(4, 3, 3), workers=(None, None, None))
    """
    if num_samples < 0:
        raise ValueError(f"plan_shards: num_samples must be >= 0, got {num_samples}")
    if max_shard_samples < 1:
        raise ValueError(f"plan_shards: max_shard_samples must be >= 1, got {max_shard_samples}")
    for worker, rate in throughputs.items():
        if rate is not None and not (rate > 0 and math.isfinite(rate)):
            raise ValueError(f"plan_shards: the throughput of worker {worker!r} must be > 0 or None, got {rate}")
    even = ShardPlan.even(num_samples, max(1, len(throughputs), math.ceil(num_samples / max_shard_samples)))
    if num_samples == 0 or len(even.sizes) > len(throughputs):
        return even  # more shards than workers: a queue balances itself
    known = [rate for rate in throughputs.values() if rate is not None]
    default = sum(known) / len(known) if known else 1.0
    rates = {worker: default if rate is None else rate for worker, rate in throughputs.items()}
    # Here there are as many shards as workers, or as samples when they are fewer: the fastest
    # workers take them (a stable sort: ties keep the executor's order).
    chosen = sorted(rates, key=lambda worker: -rates[worker])[:len(even.sizes)]
    weights = [rates[worker] for worker in chosen]
    if max(weights) <= BALANCE_TOLERANCE * min(weights):
        weights = [1.0] * len(chosen)
    sizes = proportional_sizes(num_samples, weights)
    if max(sizes) > max(max_shard_samples, max(even.sizes)):
        return even  # rather near-equal shards on any worker than overload the fastest one
    return ShardPlan(sizes=tuple(sizes), workers=tuple(chosen))


def proportional_sizes(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` split into ``len(weights) <= total`` parts >= 1 in proportion to ``weights``
    (largest remainder; ties go to the earlier part, so equal weights give ``divmod``'s split).

    >>> proportional_sizes(10, [1.0, 1.0, 1.0]), proportional_sizes(10, [2.0, 1.0])
    ([4, 3, 3], [7, 3])
    """
    if not weights or len(weights) > total or not all(w > 0 for w in weights):
        raise ValueError(f"proportional_sizes: need 1 to total={total} positive weights, got {list(weights)}")
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


def observe_rate(previous: float | None, samples: int, seconds: float) -> float:
    """The throughput EWMA (samples/s) after a shard of ``samples > 0`` took ``seconds``.

    >>> observe_rate(None, 10, 0.5), observe_rate(100.0, 10, 0.05)
    (20.0, 130.0)
    """
    if samples < 1:
        raise ValueError(f"observe_rate: samples must be >= 1, got {samples}")
    rate = samples / max(seconds, 1e-6)
    return rate if previous is None else (1 - EWMA_ALPHA) * previous + EWMA_ALPHA * rate


def cut_shards(inputs: Sequence[torch.Tensor], targets: torch.Tensor, plan: ShardPlan, *,
               augmentation_multiplicity: int, batch_first: bool) -> list[Shard]:
    """The batch cut as ``plan`` says: shard ``i`` holds rows ``[start_i*K, (start_i+sizes[i])*K)``
    of every input and of the targets, as views (no copy), and carries the worker it is meant for.

    Args:
        inputs: the positional inputs, N*K rows each on the batch dimension.
        targets: the targets, laid out like the inputs.
        plan: sizes adding up to N.
        augmentation_multiplicity: K, the rows per sample.
        batch_first: the batch dimension is 0 (True) or 1 (False).
    """
    K = augmentation_multiplicity
    batch_dim = 0 if batch_first else 1
    rows = plan.num_samples * K
    if K < 1 or any(t.dim() <= batch_dim or t.shape[batch_dim] != rows for t in (*inputs, targets)):
        raise ValueError(f"cut_shards: a plan of {plan.num_samples} samples with K={K} needs {rows} rows on "
                         f"dimension {batch_dim}; got shapes {[list(t.shape) for t in (*inputs, targets)]}")
    shards, start = [], 0
    for index, (samples, worker) in enumerate(zip(plan.sizes, plan.workers)):
        shard_inputs = tuple(t.narrow(batch_dim, start * K, samples * K) for t in inputs)  # (n*K, ...)
        shard_targets = targets.narrow(batch_dim, start * K, samples * K)  # (n*K, ...)
        shards.append(Shard(index=index, inputs=shard_inputs, targets=shard_targets, worker=worker))
        start += samples
    return shards
