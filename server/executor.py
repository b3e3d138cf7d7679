"""Where shards run: the :class:`ShardExecutor` protocol and its in-process implementation.

The frontend hands an executor one step at a time: the session's :class:`SessionSpec` (enough to
rebuild the model anywhere), the :class:`ParameterSet` of the requested version and the batch cut
into :class:`Shard` objects (by :mod:`psg_server.scheduler`, from the executor's
:meth:`~ShardExecutor.throughputs`). The executor returns one :class:`ShardResult` (a
:class:`~psg_core.config.DPGradient` whose gradients are views of one flat buffer, with the worker's
timings) per shard, in shard order; the frontend merges, noises and accounts. :class:`ShardRunner`
is the part every executor shares: it keeps one model per session resident on its device
(:mod:`psg_server.resident`), loads a new parameter version as one flat buffer (the frozen
parameters only when they changed) and calls :func:`psg_core.dp.dp_gradient`, or, for a session
opened with ``capture`` (:attr:`SessionSpec.capture`), the model's
:class:`psg_core.capture.CapturedStep`, which records a shard shape's step once and replays it. The
Ray pool wraps the same runner in actors.

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
import functools
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from psg_core.config import DPConfig, DPGradient
from psg_core.modes import GradSampleMode
from psg_core.layout import ModelInputs
from psg_core.errors import PsgError
from psg_server.errors import InvalidRequestError, NoWorkersError
from psg_server.losses import get_loss
from psg_server.models import ModelRegistry
from psg_server.resident import ResidentModel, resolve_device
from psg_wire.adapters import LoraAdapter
from psg_wire.flat import FlatTensors

if TYPE_CHECKING:
    from psg_core.capture import CapturedStep

__all__ = ["CAPTURE_PATHS", "InProcessExecutor", "ParameterSet", "SessionSpec", "Shard", "ShardExecutor", "ShardResult",
           "ShardRunner", "ShardTimings", "WorkerDescription", "model_failure"]

logger = logging.getLogger(__name__)


#: Top-level packages whose code is the service's own (and torch's, which runs every model's ops):
#: an error raised there, outside a model's own code, is the server's fault.
_SERVICE_PACKAGES = frozenset({"psg_core", "psg_server", "psg_wire", "psg_client"})
#: Errors a model's code raises on inputs or a config it cannot run (OutOfMemoryError is excluded:
#: a RuntimeError, but the machine's limit, not the caller's input).
_MODEL_ERRORS = (RuntimeError, ValueError, IndexError, KeyError, TypeError, AssertionError)


def model_failure(error: BaseException, model: str) -> InvalidRequestError | None:
    """The caller's error for an exception the session's model raised in its own code during a step
    (a config transformers accepted that the model cannot run: a partial rotary factor above 1, a
    Swin window larger than its patch grid), None for anything else (psg's or the server's own
    errors, and out-of-memory, stay what they are).

    The raiser is the innermost frame outside torch (whose ops every model runs) and psg's
    torch-function modes (which relay them): a module of the model's package (transformers, a
    plugin) makes it the model's failure.

    >>> model_code = {"__name__": "transformers.models.toy.modeling_toy"}
    >>> exec("def forward():\\n    raise RuntimeError('window 16 > 8')", model_code)
    >>> try:
    ...     model_code["forward"]()
    ... except RuntimeError as err:
    ...     failure = model_failure(err, "toy")
    >>> "failed in its own code (transformers.models.toy.modeling_toy)" in str(failure), type(failure).__name__
    (True, 'InvalidRequestError')
    """
    if isinstance(error, PsgError) or isinstance(error, torch.OutOfMemoryError) \
            or not isinstance(error, _MODEL_ERRORS):
        return None
    modules = []
    tb = error.__traceback__
    while tb is not None:
        # (psg's torch-function modes relay every op the model calls: not the raiser either)
        if tb.tb_frame.f_code.co_name != "__torch_function__":
            modules.append(str(tb.tb_frame.f_globals.get("__name__", "")))
        tb = tb.tb_next
    raiser = next((name for name in reversed(modules) if name.split(".")[0] != "torch"), "")
    if not raiser or raiser.split(".")[0] in _SERVICE_PACKAGES or raiser == "__main__":
        return None
    text = " ".join(str(error).split())[:300] or type(error).__name__
    return InvalidRequestError(f"ComputeGradients: model {model!r} failed in its own code ({raiser}) on this "
                               f"batch: {type(error).__name__}: {text}; its config (or the batch) does not fit it")

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
    #: The LoRA adapter added to the model, if any.
    lora: LoraAdapter | None = None
    #: Run the steps through a :class:`~psg_core.capture.CapturedStep` per resident model (recorded
    #: once per shard signature, then replayed); never together with adaptive clipping, whose
    #: per-shard bound (:attr:`Shard.max_grad_norm`) a recorded step would hold fixed.
    capture: bool = False

    @property
    def model_kwargs(self) -> dict[str, Any]:
        """The kwargs, decoded (lists become tuples, as builders annotate them)."""
        decoded = json.loads(self.model_kwargs_json)
        return {k: tuple(v) if isinstance(v, list) else v for k, v in decoded.items()}


@dataclass(frozen=True)
class ParameterSet:
    """One version of a session's parameters (host tensors, named as in named_parameters()).

    A push that leaves out the frozen parameters (``requires_grad=False``) keeps those of the
    previous set: ``tensors`` then shares them with it, and ``frozen_version`` still names the
    version whose push carried them, so a worker whose model holds them already loads only the
    trainable ones. Workers receive the set as two flat buffers: :attr:`varying` (every parameter
    not in ``frozen``) with each version, :attr:`fixed` (the ``frozen`` ones) once per frozen version.
    """

    version: int
    tensors: Mapping[str, torch.Tensor]
    #: The version whose push carried the frozen parameters; 0 = this one (or there are none).
    frozen_version: int = 0
    #: Names of the frozen parameters in ``tensors`` (empty: every parameter travels with each version).
    frozen: frozenset[str] = frozenset()

    @functools.cached_property
    def varying(self) -> FlatTensors:
        """The parameters not in ``frozen``, as one flat buffer (a view, without a copy, when they
        arrived as one group)."""
        return FlatTensors.pack([(name, t) for name, t in self.tensors.items() if name not in self.frozen])

    @functools.cached_property
    def fixed(self) -> FlatTensors | None:
        """The frozen parameters as one flat buffer; None when there are none."""
        named = [(name, t) for name, t in self.tensors.items() if name in self.frozen]
        return FlatTensors.pack(named) if named else None

    @property
    def frozen_from(self) -> int:
        """The version the frozen tensors came with."""
        return self.frozen_version or self.version

    @property
    def num_bytes(self) -> int:
        """Bytes held by the tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass(frozen=True)
class Shard:
    """A contiguous run of samples (K rows each) of one batch, as planned by
    :func:`psg_server.scheduler.plan_shards`."""

    index: int
    #: The model's inputs: the positional ones, then the keyword ones named by ``keywords``.
    inputs: tuple[torch.Tensor, ...]
    targets: torch.Tensor
    #: Id of the worker the plan meant the shard for; None: whichever worker is free first. An
    #: executor that balances by throughput (the Ray pool) follows it while that worker is live.
    worker: str | None = None
    #: Names of the keyword inputs: the last ``len(keywords)`` of ``inputs``.
    keywords: tuple[str, ...] = ()
    #: The flat bound to clip this shard at in place of the spec's ``dp_config.max_grad_norm``
    #: (a session with adaptive clipping: its current bound, which moves every step while the spec,
    #: and with it the workers' resident model, stays); None = the spec's.
    max_grad_norm: float | None = None

    def model_inputs(self, inputs: tuple[torch.Tensor, ...] | None = None) -> Any:
        """What :func:`psg_core.dp.dp_gradient` takes for ``inputs`` (default the shard's own,
        or the same moved to a device): a tensor, a tuple of positional tensors, a mapping of
        keyword ones, or both."""
        tensors = self.inputs if inputs is None else inputs
        count = len(tensors) - len(self.keywords)
        positional, keyword = tensors[:count], dict(zip(self.keywords, tensors[count:]))
        if not keyword:
            return positional[0] if len(positional) == 1 else positional
        return keyword if not positional else ModelInputs(tuple(positional), keyword)


@dataclass(frozen=True)
class ShardTimings:
    """Where a worker spent a shard's seconds: parameters and inputs onto its device, the DP
    computation, the result off it (on a GPU, each phase ends with a synchronisation)."""

    copy_in: float = 0.0
    compute: float = 0.0
    copy_out: float = 0.0


#: A captured session's shards are recorded and replayed padded to a multiple of this many samples
#: (psg_core.CapturedStep's ``pad_to_multiple``; the padding weighs nothing): Poisson batches, cut
#: into shards, vary in size, and each size would otherwise be a recording of its own.
CAPTURE_PAD_MULTIPLE = 8

#: How a captured session's shard ran (:attr:`ShardResult.capture_path`: the
#: :class:`~psg_core.capture.CapturedStep`'s ``last_path``): ``eager`` (a signature's first step),
#: ``recorded``, ``validated`` (checked against the eager step), ``replayed``, ``refused`` (eager:
#: the signature cannot be recorded), ``reruns`` (eager: the replay did not hold for the batch).
CAPTURE_PATHS = ("eager", "recorded", "validated", "replayed", "refused", "reruns")

@dataclass
class ShardResult(DPGradient):
    """One shard's :class:`~psg_core.config.DPGradient`, its gradients views of the one flat buffer
    ``flat`` (what crosses the object store and what the frontend sums in place), with the worker's
    :class:`ShardTimings`. Built with empty ``grads`` and a ``flat``, it takes ``grads`` from it."""

    timings: ShardTimings = field(default_factory=ShardTimings)
    flat: FlatTensors | None = None
    #: For a session with ``capture``: how its captured step ran the shard (one of
    #: :data:`CAPTURE_PATHS`); None for an eager session's shard.
    capture_path: str | None = None

    def __post_init__(self) -> None:
        if self.flat is not None and not self.grads:
            self.grads = self.flat.views()


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

    @property
    def pinned_inputs(self) -> bool:
        """Whether the frontend should decode parameters and batches into pinned host memory (the
        executor copies them to a GPU of this process, asynchronously from pinned memory)."""
        ...

    async def run(self, spec: SessionSpec, parameters: ParameterSet,
                  shards: Sequence[Shard]) -> list[ShardResult]:
        """One result per shard, in shard order; cancelling the awaiting task cancels the shards.

        The shards are run as given (the frontend planned them), so :meth:`DPGradient.merge` of the
        results is the step's result. A result's tensors are on the host, or on the device of this
        process that computed them (the in-process executor on a GPU).
        """
        ...

    async def release(self, session_id: str) -> None:
        """Drops whatever the workers cache for a closed (or expired) session."""
        ...


class ShardRunner:
    """Computes shards on one device, keeping one resident model per session (not thread-safe: one
    per worker).

    Args:
        registry: builds models by name (plugins already loaded).
        device: where models live and shards run.
    """

    def __init__(self, registry: ModelRegistry, device: torch.device | str = "cpu") -> None:
        self._registry = registry
        self.device = torch.device(device)
        self._cache: dict[str, _CachedModel] = {}

    def run_shard(self, spec: SessionSpec, parameters: ParameterSet, shard: Shard, *,
                  to_host: bool = True) -> ShardResult:
        """``dp_gradient`` of the session's model at ``parameters`` on one shard (through the
        model's :class:`~psg_core.capture.CapturedStep` when ``spec.capture`` and the shard clips
        at the spec's bound: the same result).

        The gradients come back as views of one flat buffer: on the host (``to_host``; from a GPU,
        one copy into pinned memory) or left on the device.
        """
        from psg_core.dp import dp_gradient  # the DP step lives in psg_core; imported when first used

        started = time.perf_counter()
        cached = self._model(spec, parameters)
        resident = cached.resident
        inputs = tuple(t.to(self.device, non_blocking=True) for t in shard.inputs)
        targets = shard.targets.to(self.device, non_blocking=True)
        loaded = self._synchronize()
        config = spec.dp_config if shard.max_grad_norm is None else \
            replace(spec.dp_config, max_grad_norm=shard.max_grad_norm)
        captured = self._captured(cached) if spec.capture and shard.max_grad_norm is None else None
        path: str | None = None
        try:
            if captured is not None:
                # (recordings in the process take turns inside psg_core: torch.fx patches nn.Module
                # process-wide while it traces; this runner's captured steps are its own thread's)
                result = captured(shard.model_inputs(inputs), targets)
                path = captured.last_path
            else:
                result = dp_gradient(resident.model, shard.model_inputs(inputs), targets, loss_fn=resident.loss,
                                     config=config)
        except Exception as err:
            failure = model_failure(err, spec.model)
            if failure is None:
                raise
            raise failure from err
        flat = FlatTensors.pack(result.grads)  # one buffer for the sum, the transport and the reply
        norms = result.per_sample_norms
        computed = self._synchronize()
        if to_host and self.device.type != "cpu":
            flat = flat.to("cpu", non_blocking=True, pin_memory=True)
            norms = norms.to("cpu", non_blocking=True)
        done = self._synchronize()
        timings = ShardTimings(copy_in=loaded - started, compute=computed - loaded, copy_out=done - computed)
        return ShardResult(grads={}, per_sample_norms=norms, loss_sum=result.loss_sum,
                           num_samples=result.num_samples, num_clipped=result.num_clipped,
                           num_dropped=result.num_dropped, timings=timings, flat=flat, capture_path=path)

    def release(self, session_id: str) -> None:
        """Forgets the session's model (and its captured step with it)."""
        self._cache.pop(session_id, None)

    def sessions(self) -> list[str]:
        """Ids of the sessions whose model is cached."""
        return list(self._cache)

    def capture_stats(self) -> dict[str, dict[str, int]]:
        """The :attr:`~psg_core.capture.CapturedStep.stats` of each cached session's captured step
        (sessions opened with ``capture`` that ran a shard here), by session id: copies."""
        return {session_id: dict(cached.captured.stats) for session_id, cached in self._cache.items()
                if cached.captured is not None}

    def has_parameters(self, spec: SessionSpec, version: int) -> bool:
        """Whether the session's model is cached with parameter ``version`` loaded, so a caller
        that must fetch parameters from afar (a Ray worker) can skip fetching them."""
        cached = self._cache.get(spec.session_id)
        return cached is not None and cached.spec == spec and cached.resident.version == version

    def has_frozen(self, spec: SessionSpec, frozen_version: int) -> bool:
        """Whether the session's model holds the frozen parameters pushed with ``frozen_version``."""
        cached = self._cache.get(spec.session_id)
        return cached is not None and cached.spec == spec and cached.resident.frozen_from == frozen_version

    def _synchronize(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _model(self, spec: SessionSpec, parameters: ParameterSet) -> _CachedModel:
        cached = self._cache.get(spec.session_id)
        if cached is None or cached.spec != spec:
            model = self._registry.build(spec.model, spec.model_kwargs, device=self.device, lora=spec.lora)
            model.train()
            loss = get_loss(spec.loss).build()
            cached = self._cache[spec.session_id] = _CachedModel(spec, ResidentModel(model, loss, self.device))
        resident = cached.resident
        if resident.version != parameters.version:
            # The frozen parameters (a LoRA run's whole base model) are copied only when they changed.
            fixed = parameters.fixed
            if fixed is not None and resident.frozen_from != parameters.frozen_from:
                resident.load(fixed, slot="frozen")
            resident.load(parameters.varying, slot="varying")
            resident.version, resident.frozen_from = parameters.version, parameters.frozen_from
        return cached

    @staticmethod
    def _captured(cached: _CachedModel) -> CapturedStep:
        """The cached model's captured step, made on its first captured shard. It is made again
        when the model's parameters moved to new buffers (a slot's layout changed): a captured step
        is promised parameters updated in place (as loading a version does), and a move swaps
        their ``.data`` instead, which is not that (it costs the model's shapes a new recording)."""
        from psg_core.capture import CapturedStep  # (as dp_gradient: imported when first used)

        resident = cached.resident
        if cached.captured is None or cached.captured_rehomes != resident.rehomes:
            config = cached.spec.dp_config
            pad = None if config.mode is GradSampleMode.FUNCTORCH else CAPTURE_PAD_MULTIPLE
            cached.captured = CapturedStep(resident.model, loss_fn=resident.loss, config=config, pad_to_multiple=pad)
            cached.captured_rehomes = resident.rehomes
        return cached.captured


@dataclass
class _CachedModel:
    """A session's resident model on one worker, the spec it was built for and, for a session with
    ``capture``, its captured step (and the :attr:`ResidentModel.rehomes` it was made at)."""

    spec: SessionSpec
    resident: ResidentModel
    captured: CapturedStep | None = None
    captured_rehomes: int = -1


class _ThreadWorker:
    """A :class:`ShardRunner` on its own thread: one worker runs its shards one after another."""

    def __init__(self, index: int, registry: ModelRegistry, device: torch.device) -> None:
        self.description = WorkerDescription(id=f"inprocess-{index}", device=str(device))
        self.runner = ShardRunner(registry, device)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                          thread_name_prefix=f"psg-worker-{index}")


class InProcessExecutor:
    """Runs shards on threads of this process, one :class:`ShardRunner` per worker thread.

    Shard ``i`` goes to worker ``i % num_workers``. Torch releases the GIL in its kernels, so
    workers overlap on multi-core hosts; each worker keeps its own copy of every session's model.
    On a GPU the results stay on it: the frontend sums and noises them there and copies the
    step's gradient to the host once.

    Args:
        registry: the model registry.
        num_workers: worker threads.
        device: device of every worker: "auto" (the current CUDA device when torch sees one, else
            the CPU), "cpu", "cuda" or "cuda:<i>".
    """

    def __init__(self, registry: ModelRegistry, *, num_workers: int = 1, device: str = "auto") -> None:
        if num_workers < 1:
            raise ValueError(f"InProcessExecutor: num_workers must be >= 1, got {num_workers}")
        self._registry = registry
        self._num_workers = num_workers
        self._device = resolve_device(device)
        self._workers: list[_ThreadWorker] = []

    @property
    def ready(self) -> bool:
        return bool(self._workers)

    @property
    def device(self) -> torch.device:
        """Where the workers compute."""
        return self._device

    @property
    def pinned_inputs(self) -> bool:
        return self._device.type == "cuda"

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
                  shards: Sequence[Shard]) -> list[ShardResult]:
        workers = self._workers
        if not workers:
            raise NoWorkersError("ComputeGradients: the executor has no workers (not started or closed)")
        loop = asyncio.get_running_loop()
        assigned = [(workers[i % len(workers)], shard) for i, shard in enumerate(shards)]
        futures = [loop.run_in_executor(worker.pool, functools.partial(worker.runner.run_shard, to_host=False),
                                        spec, parameters, shard)
                   for worker, shard in assigned]
        try:
            return [await futures[0]] if len(futures) == 1 else list(await asyncio.gather(*futures))
        except BaseException:
            for future in futures:
                future.cancel()  # shards not yet started never run; running ones finish and are dropped
            raise

    async def release(self, session_id: str) -> None:
        loop = asyncio.get_running_loop()
        # On each worker's own thread, so a release never races a shard using the model.
        await asyncio.gather(*(loop.run_in_executor(w.pool, w.runner.release, session_id)
                               for w in self._workers))
