"""The Ray side of the pool: :class:`GradientWorker`, one device's shard computations.

``GradientWorker`` is a plain class around a :class:`~psg_server.executor.ShardRunner`; the pool
turns it into an actor only when it creates one (``ray.remote(GradientWorker).options(...)``), so
the class can be built and called directly too. Inside an actor it runs its shards one after
another on one thread (the default concurrency group), while :meth:`ping` and :meth:`describe`
answer from a second thread (the ``control`` group), so a health probe never waits for a long
shard.

Parameters travel as :class:`~psg_server.transport.ParameterArgs`: the varying parameters' flat
buffer (inside the call, or a reference the worker fetches only when its resident model lacks that
version) and the frozen ones' reference (fetched only when the model lacks that frozen version), so
steps of an unchanged version never copy the parameters again and a LoRA run's base model crosses
once. The model stays resident on the worker's device (:mod:`psg_server.resident`).

Shards, parameter sets and results cross the object store as
:class:`~psg_server.transport.TensorPayload` (raw tensor bytes out of band: one copy each side); a
result is one flat gradient buffer. On a GPU, unpickled tensors land in pinned memory.

>>> from psg_server.worker import GradientWorker
>>> worker = GradientWorker(name="w0", num_threads=1)
>>> worker.describe().device
'cpu'
"""

from __future__ import annotations

import copy
import logging
import os
import pickle
import threading
from collections.abc import Sequence
from typing import Any

import ray
import torch

from psg_server.executor import ParameterSet, SessionSpec, Shard, ShardResult, ShardRunner, WorkerDescription
from psg_server.models import default_registry
from psg_server.transport import ParameterArgs, TensorPayload, pin_unpacked_tensors, unpack

__all__ = ["CONTROL_GROUP", "WATCH_GROUP", "GradientWorker"]

logger = logging.getLogger(__name__)

#: Concurrency group of the methods that must answer while a shard runs.
CONTROL_GROUP = "control"
#: Concurrency group of :meth:`GradientWorker.watch`, which holds its thread for the actor's life.
WATCH_GROUP = "watch"


class GradientWorker:
    """Computes shards on one device (a GPU, or ``num_threads`` CPU threads), caching one model per
    session.

    Args:
        name: the worker's name in ``GetServerInfo`` (the pool uses ``ray-worker-<slot>``).
        plugins: model plugin modules to load, as the frontend's registry did.
        num_threads: torch intra-op threads (the CPU cores Ray reserved for this worker).
        use_gpu: run on the GPU Ray assigned to this actor (``num_gpus`` 1, or a share of the GPU
            when the pool has more workers than GPUs: :mod:`psg_server.placement`).
    """

    def __init__(self, *, name: str, plugins: Sequence[str] = (), num_threads: int = 1,
                 use_gpu: bool = False) -> None:
        if num_threads < 1:
            raise ValueError(f"GradientWorker: num_threads must be >= 1, got {num_threads}")
        torch.set_num_threads(num_threads)
        if use_gpu and not torch.cuda.is_available():
            raise RuntimeError(f"GradientWorker {name}: use_gpu=True, but torch sees no CUDA device")
        # Ray narrows CUDA_VISIBLE_DEVICES to the actor's GPU, which torch then calls cuda:0.
        device = torch.device("cuda", 0) if use_gpu else torch.device("cpu")
        pin_unpacked_tensors(use_gpu)
        self._registry = default_registry(plugins)
        self._runner = ShardRunner(self._registry, device)
        self._description = WorkerDescription(id=name, device=_device_label(device), node=_node_label())
        self._shards_run = 0
        self._compute = threading.Lock()  # see run_shard
        logger.info("worker %s on %s (%s), %d torch thread(s)", name, self._description.device,
                    self._description.node or "no Ray node", num_threads)

    @ray.method(concurrency_group=CONTROL_GROUP)
    def describe(self) -> WorkerDescription:
        """Who and where this worker is."""
        return self._description

    @ray.method(concurrency_group=WATCH_GROUP)
    def watch(self) -> None:
        """Returns only when the actor dies (then with Ray's ``ActorDiedError`` at the caller): a
        direct channel's way to learn that its actor is gone (:mod:`psg_server.channel`)."""
        threading.Event().wait()

    @ray.method(concurrency_group=CONTROL_GROUP)
    def ping(self) -> int:
        """Liveness probe; returns the worker's process id."""
        return os.getpid()

    def stats(self) -> dict[str, Any]:
        """Shards run so far, the sessions whose model is cached and, for those opened with
        ``capture``, their captured steps' counters (``{session id: CapturedStep.stats}``).

        In the default group, so it answers after the calls queued before it (a :meth:`release`).
        """
        return {"shards_run": self._shards_run, "sessions": self._runner.sessions(),
                "captured": self._runner.capture_stats()}

    def run_shard(self, spec: SessionSpec, parameters: ParameterArgs, shard: Shard, *,
                  pack_result: bool = False) -> ShardResult | TensorPayload:
        """``dp_gradient`` of the session's model at parameter version ``parameters.version`` on
        one shard.

        Args:
            spec: the session.
            parameters: the version; its buffers are fetched only when the resident model lacks them.
            shard: the samples (K rows each).
            pack_result: return the result as a :class:`TensorPayload` (what the pool asks for: it
                unpickles as the :class:`ShardResult` on the caller's side, one flat buffer).
        """
        # Shards arrive by actor calls (the default group's one thread) and through a direct
        # channel (psg_server.channel: the compiled graph's own thread): one at a time either way,
        # the resident model's version checked and used under the same lock.
        with self._compute:
            if self._runner.has_parameters(spec, parameters.version):
                # The resident model already holds this version, and the runner never reads the
                # tensors of a version it has loaded: no need to fetch anything.
                current = ParameterSet(version=parameters.version, tensors={},
                                       frozen_version=parameters.frozen_from)
            else:
                current = parameters.fetch(frozen=not self._runner.has_frozen(spec, parameters.frozen_from))
            for plugin in spec.plugins:
                if plugin not in self._registry.plugins:
                    self._registry.load_plugin(plugin)
            result = self._runner.run_shard(spec, current, shard)
            self._shards_run += 1
        if not pack_result:
            return result
        # The flat buffer alone crosses the store; the receiver rebuilds the views (ShardResult).
        packed = copy.copy(result)
        packed.grads = {}
        return TensorPayload(packed)

    def run_packed(self, call: bytes) -> bytes:
        """:meth:`run_shard` of a call pickled whole by :func:`~psg_server.transport.pack_call`
        (a small step's fast path); the packed result comes back pickled too."""
        spec, parameters, shard = unpack(call)
        return pickle.dumps(self.run_shard(spec, parameters, shard, pack_result=True), protocol=5)

    def release(self, session_id: str) -> None:
        """Drops the session's cached model."""
        with self._compute:
            self._runner.release(session_id)


def _device_label(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    gpu_ids = ray.get_gpu_ids() if ray.is_initialized() else []
    # Report the physical GPU, not the cuda:0 that CUDA_VISIBLE_DEVICES makes of it.
    return f"cuda:{gpu_ids[0]}" if gpu_ids else "cuda:0"


def _node_label() -> str:
    if not ray.is_initialized():
        return ""
    context = ray.get_runtime_context()
    return f"{ray.util.get_node_ip_address()}/{context.get_node_id()[:12]}"
