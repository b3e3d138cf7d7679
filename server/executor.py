"""Where shards run: the :class:`ShardExecutor` protocol and its in-process implementation.

The frontend hands an executor one step at a time: the session's :class:`SessionSpec` (enough to
rebuild the model anywhere), the :class:`ParameterSet` of the requested version and the batch cut
into :class:`Shard` objects (by :mod:`psg_server.scheduler`, from the executor's
:meth:`~ShardExecutor.throughputs`). The executor returns one :class:`~psg_core.config.DPGradient` per
shard, in shard order; the frontend merges, noises and accounts. :class:`ShardRunner` is the part
every executor shares: it builds and caches one model per session, loads parameters on a version
change and calls :func:`psg_core.dp.dp_gradient`. The Ray pool wraps the same runner in actors.

>>> import asyncio
>>> from psg_server.models import default_registry
>>> executor = InProcessExecutor(default_registry(), num_workers=1)
>>> asyncio.run(executor.start()); executor.ready
True
>>> asyncio.run(executor.close())
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from psg_core.config import DPConfig, DPGradient
from psg_server.errors import NoWorkersError
from psg_server.losses import get_loss
from psg_server.models import ModelRegistry

__all__ = ["InProcessExecutor", "ParameterSet", "SessionSpec", "Shard", "ShardExecutor", "ShardRunner",
           "WorkerDescription"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SessionSpec:
    """Everything a worker needs to rebuild a session's model and loss."""

    session_id: str
    model: str
    #: The model's keyword arguments as canonical JSON (sorted keys), so the spec is hashable.
    model_kwargs_json: str
    loss: str
    dp_config: DPConfig
    #: Plugin modules the worker's registry must load to know ``model``.
    plugins: tuple[str, ...] = ()

    @property
    def model_kwargs(self) -> dict[str, Any]:
        """The kwargs, decoded (lists become tuples, as builders annotate them)."""
        decoded = json.loads(self.model_kwargs_json)
        return {k: tuple(v) if isinstance(v, list) else v for k, v in decoded.items()}


@dataclass(frozen=True)
class ParameterSet:
    """One pushed version of a session's parameters (CPU tensors, named as in named_parameters())."""

    version: int
    tensors: Mapping[str, torch.Tensor]

    @property
    def num_bytes(self) -> int:
        """Bytes held by the tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass(frozen=True)
class Shard:
    """A contiguous run of samples (K rows each) of one batch, as planned by
    :func:`psg_server.scheduler.plan_shards`."""

    index: int
    inputs: tuple[torch.Tensor, ...]
    targets: torch.Tensor
    #: Id of the worker the plan meant the shard for; None: whichever worker is free first. An
    #: executor that balances by throughput (the Ray pool) follows it while that worker is live.
    worker: str | None = None


@dataclass(frozen=True)
class WorkerDescription:
    """A worker as ``GetServerInfo`` lists it."""

    id: str
    device: str
    #: Where the worker runs: empty for in-process workers, ``<ip>/<node id>`` for Ray workers.
    node: str = ""


@runtime_checkable
class ShardExecutor(Protocol):
    """Runs the shards of a step. Implementations: :class:`InProcessExecutor`, the Ray pool."""

    @property
    def ready(self) -> bool:
        """True once :meth:`start` finished and workers are available (drives health)."""
        ...

    async def start(self) -> None:
        """Brings the workers up."""
        ...

    async def close(self) -> None:
        """Stops the workers; pending shards are cancelled."""
        ...

    def workers(self) -> list[WorkerDescription]:
        """The live workers."""
        ...

    def throughputs(self) -> dict[str, float | None]:
        """The live workers' measured throughput in samples/s (None where not measured), keyed by
        worker id in the executor's order: what :func:`psg_server.scheduler.plan_shards` weighs."""
        ...

    async def run(self, spec: SessionSpec, parameters: ParameterSet,
                  shards: Sequence[Shard]) -> list[DPGradient]:
        """One result per shard, in shard order; cancelling the awaiting task cancels the shards.

        The shards are run as given (the frontend planned them), so :meth:`DPGradient.merge` of the
        results is the step's result.
        """
        ...

    async def release(self, session_id: str) -> None:
        """Drops whatever the workers cache for a closed (or expired) session."""
        ...


class ShardRunner:
    """Computes shards on one device, caching one model per session (not thread-safe: one per worker).

    Args:
        registry: builds models by name (plugins already loaded).
        device: where models live and shards run.
    """

    def __init__(self, registry: ModelRegistry, device: torch.device | str = "cpu") -> None:
        self._registry = registry
        self.device = torch.device(device)
        # session id -> (spec, loaded parameter version, model, loss)
        self._cache: dict[str, tuple[SessionSpec, int, nn.Module, nn.Module]] = {}

    def run_shard(self, spec: SessionSpec, parameters: ParameterSet, shard: Shard) -> DPGradient:
        """``dp_gradient`` of the session's model at ``parameters`` on one shard (results on CPU)."""
        from psg_core.dp import dp_gradient  # the DP step lives in psg_core; imported when first used

        model, loss = self._model(spec, parameters)
        inputs = tuple(t.to(self.device, non_blocking=True) for t in shard.inputs)
        targets = shard.targets.to(self.device, non_blocking=True)
        result = dp_gradient(model, inputs if len(inputs) > 1 else inputs[0], targets, loss_fn=loss,
                             config=spec.dp_config)
        if self.device.type == "cpu":
            return result
        return DPGradient(grads={name: g.cpu() for name, g in result.grads.items()},
                          per_sample_norms=result.per_sample_norms.cpu(), loss_sum=result.loss_sum,
                          num_samples=result.num_samples, num_clipped=result.num_clipped)

    def release(self, session_id: str) -> None:
        """Forgets the session's model."""
        self._cache.pop(session_id, None)

    def sessions(self) -> list[str]:
        """Ids of the sessions whose model is cached."""
        return list(self._cache)

    def has_parameters(self, spec: SessionSpec, version: int) -> bool:
        """Whether the session's model is cached with parameter ``version`` loaded, so a caller
        that must fetch parameters from afar (a Ray worker) can skip fetching them."""
        cached = self._cache.get(spec.session_id)
        return cached is not None and cached[0] == spec and cached[1] == version

    def _model(self, spec: SessionSpec, parameters: ParameterSet) -> tuple[nn.Module, nn.Module]:
        cached = self._cache.get(spec.session_id)
        if cached is None or cached[0] != spec:
            model = self._registry.build(spec.model, spec.model_kwargs, device=self.device)
            model.train()
            cached = (spec, -1, model, get_loss(spec.loss).build())
        _, loaded_version, model, loss = cached
        if loaded_version != parameters.version:
            named = dict(model.named_parameters())
            with torch.no_grad():
                for name, tensor in parameters.tensors.items():
                    named[name].copy_(tensor, non_blocking=True)
        self._cache[spec.session_id] = (spec, parameters.version, model, loss)
        return model, loss


class _ThreadWorker:
    """A :class:`ShardRunner` on its own thread: one worker runs its shards one after another."""

    def __init__(self, index: int, registry: ModelRegistry, device: str) -> None:
        self.description = WorkerDescription(id=f"inprocess-{index}", device=device)
        self.runner = ShardRunner(registry, device)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                          thread_name_prefix=f"psg-worker-{index}")


class InProcessExecutor:
    """Runs shards on threads of this process, one :class:`ShardRunner` per worker thread.

    Shard ``i`` goes to worker ``i % num_workers``. Torch releases the GIL in its kernels, so
    workers overlap on multi-core hosts; each worker keeps its own copy of every session's model.

    Args:
        registry: the model registry.
        num_workers: worker threads.
        device: device of every worker ("cpu", "cuda:0", ...).
    """

    def __init__(self, registry: ModelRegistry, *, num_workers: int = 1, device: str = "cpu") -> None:
        if num_workers < 1:
            raise ValueError(f"InProcessExecutor: num_workers must be >= 1, got {num_workers}")
        self._registry = registry
        self._num_workers = num_workers
        self._device = device
        self._workers: list[_ThreadWorker] = []

    @property
    def ready(self) -> bool:
        return bool(self._workers)

    async def start(self) -> None:
        if not self._workers:
            self._workers = [_ThreadWorker(i, self._registry, self._device) for i in range(self._num_workers)]
            logger.info("executor: %d in-process worker(s) on %s", self._num_workers, self._device)

    async def close(self) -> None:
        workers, self._workers = self._workers, []
        for worker in workers:
            worker.pool.shutdown(wait=False, cancel_futures=True)

    def workers(self) -> list[WorkerDescription]:
        return [worker.description for worker in self._workers]

    def throughputs(self) -> dict[str, float | None]:
        # Threads of one process are alike: not measured, so the scheduler weighs them equally.
        return {worker.description.id: None for worker in self._workers}

    async def run(self, spec: SessionSpec, parameters: ParameterSet,
                  shards: Sequence[Shard]) -> list[DPGradient]:
        workers = self._workers
        if not workers:
            raise NoWorkersError("ComputeGradients: the executor has no workers (not started or closed)")
        loop = asyncio.get_running_loop()
        assigned = [(workers[i % len(workers)], shard) for i, shard in enumerate(shards)]
        futures = [loop.run_in_executor(worker.pool, worker.runner.run_shard, spec, parameters, shard)
                   for worker, shard in assigned]
        try:
            return list(await asyncio.gather(*futures))
        except BaseException:
            for future in futures:
                future.cancel()  # shards not yet started never run; running ones finish and are dropped
            raise

    async def release(self, session_id: str) -> None:
        loop = asyncio.get_running_loop()
        # On each worker's own thread, so a release never races a shard using the model.
        await asyncio.gather(*(loop.run_in_executor(w.pool, w.runner.release, session_id)
                               for w in self._workers))
